"""The prefill cap in step time (`max_prefill_ms_while_decoding`, services/scheduler/prefill_pacing.py): the
scheduler turns the time a chunk may add to a decode step into tokens with the cost per token it measured from the
shard's forward seconds, so the chunk follows that cost; with a token cap too the smaller wins."""

import numpy as np
import pytest

from libs.protocol import codec
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler import prefill_pacing
from services.scheduler.batcher import Batcher
from services.scheduler.prefill_pacing import PrefillPacing

STREAMS = 16


def test_no_cap_while_nothing_decodes_and_none_configured():
    assert PrefillPacing(0, 0).cap(decoding=16) is None
    assert PrefillPacing(512, 200).cap(decoding=0) is None


def test_time_cap_in_tokens_from_the_measured_cost():
    p = PrefillPacing(0, 300)
    assert p.cap(16) == prefill_pacing.FIRST_CHUNK  # nothing measured yet
    p.planned(1, 0, 16)
    p.observed(1, 0.100)  # a decode-only step: 100 ms
    p.planned(2, 200, 16)
    p.observed(2, 0.500)  # 200 prompt tokens beside the decodes: 400 ms more, 2 ms a token
    assert p.cap(16) == 150  # 300 ms / 2 ms
    p.planned(3, 150, 16)
    p.observed(3, 0.700)  # dearer now (a longer context): 4 ms a token; the estimate moves halfway
    assert p.cap(16) == 100  # 300 ms / 3 ms
    assert PrefillPacing(64, 300).cap(16) == 64  # both set: the token cap is smaller here


def test_the_chunk_never_drops_below_one_block_and_small_or_unknown_steps_teach_nothing():
    p = PrefillPacing(0, 1)
    p.planned(1, 100, 16)
    p.observed(1, 10.0)  # 100 ms a token: 1 ms allows none, the floor feeds one block
    assert p.cap(16) == prefill_pacing.MIN_CHUNK
    p.planned(2, 8, 16)
    p.observed(2, 0.001)  # too few tokens to say what one costs
    p.observed(99, 0.001)  # a step it never planned
    assert p.token_s == pytest.approx(0.1)
    p.planned(3, 100, 16)
    p.forget()  # that step's result will not come
    p.observed(3, 0.001)
    assert p.token_s == pytest.approx(0.1)


def _req(rid: str, prompt_len: int, max_new: int, first: int) -> Req:
    ids = np.arange(first, first + prompt_len, dtype=np.int32)
    return Req(request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(), max_new_tokens=max_new)


def _run(b: Batcher, step: int, base_s: float, token_s: float) -> tuple[dict[int, int], object]:
    """One step with a shard whose forward takes base_s + token_s per prompt token (the scheduler's only view of
    the step's cost); token 7 for every sampled row."""
    plan = b.plan(step)
    rows = dict(zip(plan.seqs.tolist(), plan.num_tokens.tolist()))
    seqs = [s for s, want in zip(plan.seqs.tolist(), plan.sample.tolist()) if want]
    res = StepResult(
        step=plan.step,
        seqs=np.array(seqs, np.int32),
        token_ids=np.full(len(seqs), 7, np.int32),
        logprobs=np.zeros(len(seqs), np.float32),
        forward_s=base_s + token_s * sum(n for n in rows.values() if n > 1),
    )
    b.apply(codec.decode(codec.encode(res)))
    return rows, plan


def test_a_long_prompt_among_streams_is_fed_in_chunks_that_fit_the_time_cap():
    b = Batcher(
        2000,
        max_batch_size=32,
        max_batch_prefill_tokens=4096,
        eos_ids={2},
        max_waiting_tokens=0,
        max_prefill_tokens_while_decoding=0,
        max_prefill_ms_while_decoding=100,
    )
    for i in range(STREAMS):
        b.add(_req(f"s{i}", 8, 200, first=10 + 100 * i))
    step = 1
    _run(b, step, 0.0, 0.001)  # the streams' prefill (nothing decodes yet, so no cap): 1 ms a token
    for _ in range(3):  # decode-only steps: 50 ms each
        step += 1
        _run(b, step, 0.05, 0.001)
    b.add(_req("long", 1000, 1, first=5000))
    long_seq, fed = None, []
    while long_seq is None or long_seq in b.running:
        step += 1
        rows, plan = _run(b, step, 0.05, 0.002)  # the long prompt costs 2 ms a token
        if long_seq is None and plan.new:
            long_seq = plan.new[0].seq
        if long_seq in rows:
            fed.append(rows.pop(long_seq))
            assert sum(n == 1 for n in rows.values()) == STREAMS  # every stream decoded in that step
    assert sum(fed) == 1000 and b.counters["chunked_prefills"] == 1
    # the first chunk is sized by the streams' own prefill (1 ms a token: 100 tokens); from the second on, by what
    # the long prompt's chunks cost: 100 ms / 2 ms = 50 tokens (the estimate halves toward it chunk by chunk)
    assert fed[0] == 100
    assert fed[1:4] == [66, 57, 53], fed
    assert all(n == 50 for n in fed[6:-1]), fed
