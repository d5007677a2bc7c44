"""The batcher's policy: FIFO admission within the budgets, joining a running batch, leaving at once."""

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import FINISH_ABORTED, FINISH_EOS, FINISH_LENGTH, FINISH_NONE
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher

EOS = 2


def req(rid: str, prompt_len: int, max_new: int) -> Req:
    ids = np.arange(10, 10 + prompt_len, dtype=np.int32)
    return Req(request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(), max_new_tokens=max_new)


def result(plan, tokens: dict[int, int]) -> StepResult:
    seqs = [s for s in plan.seqs.tolist() if s in tokens]
    res = StepResult(
        step=plan.step,
        seqs=np.array(seqs, np.int32),
        token_ids=np.array([tokens[s] for s in seqs], np.int32),
        logprobs=np.zeros(len(seqs), np.float32),
    )
    return codec.decode(codec.encode(res))  # as the scheduler receives it: every frame an array


def test_prefill_then_decode_and_join():
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids={EOS})
    b.add(req("a", 20, 5))
    p1 = b.plan(1)
    assert p1.num_tokens.tolist() == [20] and p1.context_lens.tolist() == [0]
    assert len(p1.new) == 1 and len(p1.blocks[p1.seqs[0]]) == 2  # ceil((20+5)/16)
    a = int(p1.seqs[0])
    rows = b.apply(result(p1, {a: 7}))
    assert [(r.offset, r.token_id, r.finish) for r in rows] == [(0, 7, FINISH_NONE)]
    b.add(req("b", 10, 3))  # arrives while "a" is mid-generation
    p2 = b.plan(2)
    assert p2.num_tokens.tolist() == [1, 10] and p2.context_lens.tolist() == [20, 0]
    assert p2.token_ids.tolist()[0] == 7  # a's last token is fed back
    assert b.counters["joined_steps"] == 1


def test_length_before_eos_and_blocks_freed():
    b = Batcher(10, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids={EOS})
    b.add(req("a", 4, 1))
    p = b.plan(1)
    (row,) = b.apply(result(p, {int(p.seqs[0]): EOS}))
    assert row.finish == FINISH_LENGTH  # TGI: length is checked before EOS
    assert b.allocator.free == 10 and not b.has_work()
    assert b.plan(2) is None
    b.add(req("b", 4, 5))
    p = b.plan(3)
    assert p.finished == [int(row.seq.seq)]  # the shard hears about the finished sequence
    (row,) = b.apply(result(p, {int(p.seqs[0]): EOS}))
    assert row.finish == FINISH_EOS


def test_admission_chunks_within_the_prefill_budget_in_fifo_order():
    b = Batcher(8, max_batch_size=2, max_batch_prefill_tokens=30, eos_ids={EOS})
    b.add(req("a", 20, 12))
    b.add(req("b", 20, 12))  # only 10 tokens of budget left: a first chunk, not sampled
    b.add(req("c", 1, 1))  # a partial prefill ends the batch (TGI); FIFO: never overtakes b
    p = b.plan(1)
    assert p.num_tokens.tolist() == [20, 10] and p.sample.tolist() == [1, 0]
    assert b.counters["chunked_prefills"] == 1
    a, bb = p.seqs.tolist()
    b.apply(result(p, {a: 5}))
    p = b.plan(2)
    assert p.seqs.tolist() == [a, bb] and p.num_tokens.tolist() == [1, 10] and p.context_lens.tolist() == [20, 10]
    assert p.sample.tolist() == [1, 1] and p.token_ids[1:].tolist() == list(range(20, 30))
    assert len(b.running) == 2 and [s.req.request_id for s in b.waiting] == ["c"]  # max_batch_size


def test_kv_budget_blocks_admission():
    b = Batcher(3, max_batch_size=8, max_batch_prefill_tokens=1000, eos_ids={EOS})
    b.add(req("a", 30, 2))  # 2 blocks
    b.add(req("b", 30, 2))  # needs 2, only 1 free
    p = b.plan(1)
    assert len(p.seqs) == 1 and b.allocator.free == 1


def test_abort_running_and_waiting():
    b = Batcher(100, max_batch_size=1, max_batch_prefill_tokens=64, eos_ids={EOS})
    b.add(req("a", 5, 5))
    b.add(req("b", 5, 5))
    b.plan(1)
    ended = b.finish("a")
    assert ended.finish == FINISH_ABORTED and ended.token_id == -1 and b.allocator.free == 100
    ended = b.finish("b")  # still waiting
    assert ended is not None and not b.has_work()
    assert b.finish("zzz") is None  # idempotent for unknown ids


def test_duplicate_delivery_is_ignored():
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids={EOS})
    b.add(req("a", 5, 5))
    b.add(req("a", 5, 5))
    assert len(b.waiting) == 1
