"""The scheduler's recovery bookkeeping (docs/recovery.md): a shard restart re-prefills what ran (nothing
streamed twice), the stream log replays a request from offset 0 (also a while after its end), and aborted ids
are remembered (no model)."""

import time

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import FINISH_ABORTED, FINISH_LENGTH
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher
from services.scheduler.recovery import Forgotten, StreamLog
from services.scheduler.sequence import Emitted
from services.scheduler.token_batch import token_batch

EOS = 2


def req(rid, ids, max_new=4) -> Req:
    ids = np.asarray(ids, np.int32)
    return Req(request_id=rid, ingress=3, input_ids=ids, sampling=SamplingParams(), max_new_tokens=max_new)


def result(plan, token=7) -> StepResult:
    seqs = plan.seqs[plan.sample.astype(bool)]
    res = StepResult(
        step=plan.step, seqs=seqs, token_ids=np.full(len(seqs), token, np.int32), logprobs=np.zeros(len(seqs))
    )
    return codec.decode(codec.encode(res))  # as the scheduler receives it: every frame an array


def test_shard_restart_requeues_running_for_recompute():
    b = Batcher(20, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    b.add(req("a", list(range(10, 19)), 6))
    b.add(req("b", list(range(30, 35)), 6))
    b.apply(result(b.plan(1), 7))
    b.apply(result(b.plan(2), 8))
    assert {s.req.request_id: s.output for s in b.running.values()} == {"a": [7, 8], "b": [7, 8]}
    b.requeue_running()
    assert not b.running and [s.req.request_id for s in b.waiting] == ["a", "b"]  # oldest first
    assert b.allocator.free == 20 and b.allocator.cached == 0  # the KV the index named is gone
    p = b.plan(3)
    assert p.finished == []  # the restarted shard knows no old handle
    # each is fed its prompt and what it generated; the next token continues at offset 2
    assert p.num_tokens.tolist() == [9 + 2, 5 + 2] and p.context_lens.tolist() == [0, 0]
    rows = b.apply(result(p, 9))
    assert [(r.seq.req.request_id, r.offset, r.token_id) for r in rows] == [("a", 2, 9), ("b", 2, 9)]


def test_shard_restart_when_idle_empties_the_prefix_index():
    """Nothing running, but finished requests left cached blocks: after a shard restart they name lost KV."""
    b = Batcher(20, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    prompt = list(range(10, 19))
    b.add(req("a", prompt, 1))
    b.apply(result(b.plan(1), 7))
    assert not b.running and b.allocator.cached > 0
    b.requeue_running()
    assert b.allocator.cached == 0 and b.allocator.free == 20
    b.add(req("b", prompt, 1))
    assert b.plan(2).context_lens.tolist() == [0]  # no prefix hit: the whole prompt is fed again


def test_replay_holds_the_whole_stream_and_outlives_the_end():
    b = Batcher(20, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    b.add(req("a", [5, 6, 7], 2))
    log = StreamLog(grace_s=60)
    for step in (1, 2):
        rows = b.apply(result(b.plan(step), 10 + step))
        batch = token_batch(0, rows)
        log.record(batch, rows)
    assert log.get("a") is not None and "a" not in log.live  # ended, kept for the grace period
    again = log.replay(0, "a")
    assert again.reset == ["a"] and [o.request_id for o in again.opens] == ["a"]
    assert again.offsets.tolist() == [0, 1] and again.token_ids.tolist() == [11, 12]
    assert again.finish.tolist() == [0, FINISH_LENGTH] and again.opens[0].prompt_tail == [5, 6, 7]
    assert log.replay(0, "nobody") is None


def test_failed_request_is_remembered_with_its_error_and_expires():
    log = StreamLog(grace_s=0.05)
    log.fail("x", "Request failed during generation: Server error: boom")
    assert log.get("x").error.endswith("boom") and log.replay(0, "x") is None
    time.sleep(0.06)
    log.expire()
    assert log.get("x") is None


def test_abort_end_row_ends_the_stream():
    b = Batcher(20, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    b.add(req("a", [5, 6, 7], 9))
    log = StreamLog()
    rows = b.apply(result(b.plan(1)))
    log.record(token_batch(0, rows), rows)
    end = [b.finish("a")]
    log.record(token_batch(0, end), end)
    assert "a" in log.ended and log.replay(0, "a").finish.tolist() == [0, FINISH_ABORTED]


def test_forgotten_ids_expire():
    f = Forgotten(keep_s=0.05, keep_max=2)
    f.add("a")
    assert "a" in f and "b" not in f
    f.add("b")
    f.add("c")  # over the bound: the oldest goes
    assert "a" not in f and "c" in f
    time.sleep(0.06)
    assert "c" not in f


def test_rows_an_end_overtook_take_their_place_before_it():
    """An end row recorded before rows it overtook (published out of order): a replay is still whole and in
    order, so a resync's answer has no hole for the detokenizer to ask about again; rows past the end stay out."""
    b = Batcher(20, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    b.add(req("a", [5, 6, 7], 9))
    log = StreamLog()
    steps = []
    for step, token in ((1, 40), (2, 41), (3, 42)):
        steps.append(b.apply(result(b.plan(step), token)))
    end = [b.finish("a")]
    for rows in (steps[0], end, steps[2], steps[1], steps[2]):  # the end first, then what it overtook (twice)
        log.record(token_batch(0, rows), rows)
    replay = log.replay(0, "a")
    assert replay.offsets.tolist() == [0, 1, 2, 3] and replay.token_ids.tolist() == [40, 41, 42, -1]
    late = [Emitted(end[0].seq, 3, 43, 0.0, 0), Emitted(end[0].seq, 4, 44, 0.0, 0)]  # at and past the end
    log.record(token_batch(0, late), late)
    assert log.replay(0, "a").offsets.tolist() == [0, 1, 2, 3]
