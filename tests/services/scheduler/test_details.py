"""Top-n alternatives and prompt logprobs: from hand-made StepResults, through the batcher, into TokenBatches."""

import math

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import FINISH_ABORTED, TokenBatch
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher
from services.scheduler.token_batch import token_batch

EOS = 2


def req(rid: str, prompt_len: int, max_new: int = 4, **sampling) -> Req:
    ids = np.arange(10, 10 + prompt_len, dtype=np.int32)
    return Req(request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(**sampling), max_new_tokens=max_new)


def wire(msg):
    """Through the real codec, so the frames are what a receiver would see (and the invariants are checked)."""
    return codec.decode(codec.encode(msg))


def result(step, rows, top=None, prompt=None) -> StepResult:
    """rows: [(seq, token)]; top: {seq: [(id, logprob), …]}; prompt: [(seq, [logprob, …])] in feed order."""
    top = top or {}
    prompt = prompt or []
    seqs = [s for s, _ in rows]
    alts = [top.get(s, []) for s in seqs]
    return wire(
        StepResult(
            step=step,
            seqs=np.array(seqs, np.int32),
            token_ids=np.array([t for _, t in rows], np.int32),
            logprobs=np.full(len(rows), -0.5, np.float32),
            top_counts=np.array([len(a) for a in alts] if top else [], np.int32),
            top_ids=np.array([i for a in alts for i, _ in a], np.int32),
            top_logprobs=np.array([lp for a in alts for _, lp in a], np.float32),
            prompt_seqs=np.array([s for s, _ in prompt], np.int32),
            prompt_counts=np.array([len(lps) for _, lps in prompt], np.int32),
            prompt_logprobs=np.array([lp for _, lps in prompt for lp in lps], np.float32),
        )
    )


def batcher() -> Batcher:
    return Batcher(100, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS})


def test_alternatives_follow_their_rows():
    b = batcher()
    b.add(req("a", 3, top_n_tokens=2))
    b.add(req("b", 3))  # asked for none: zero alternatives in the middle
    b.add(req("c", 3, top_n_tokens=1))
    p = b.plan(1)
    a, bb, c = p.seqs.tolist()
    top = {a: [(7, -0.1), (8, -2.5)], c: [(9, -0.3)]}
    rows = b.apply(result(1, [(a, 7), (bb, 5), (c, 9)], top=top))
    assert [(r.top_ids, r.top_logprobs) for r in rows] == [
        ([7, 8], [np.float32(-0.1), np.float32(-2.5)]),
        ([], []),
        ([9], [np.float32(-0.3)]),
    ]
    batch = wire(token_batch(0, rows))
    assert batch.request_ids == ["a", "b", "c"]
    assert batch.top_counts.tolist() == [2, 0, 1]
    assert batch.top_ids.tolist() == [7, 8, 9]
    assert np.allclose(batch.top_logprobs, [-0.1, -2.5, -0.3])


def test_a_row_skipped_after_abort_does_not_shift_the_alternatives():
    b = batcher()
    b.add(req("a", 3, top_n_tokens=2))
    b.add(req("b", 3, top_n_tokens=1))
    p = b.plan(1)
    a, bb = p.seqs.tolist()
    b.finish("a")  # aborted while the step ran: its row (and its alternatives) are dropped
    (row,) = b.apply(result(1, [(a, 7), (bb, 5)], top={a: [(7, -0.1), (8, -2.0)], bb: [(5, -0.2)]}))
    assert row.seq.req.request_id == "b" and row.top_ids == [5]


def test_no_alternatives_means_empty_frames():
    b = batcher()
    b.add(req("a", 3))
    p = b.plan(1)
    rows = b.apply(result(1, [(int(p.seqs[0]), 5)]))  # top_counts empty: nobody asked
    batch = wire(token_batch(0, rows))
    assert isinstance(batch, TokenBatch)
    assert len(batch.top_counts) == len(batch.top_ids) == len(batch.top_logprobs) == 0
    assert batch.opens[0].prompt_ids == [] and batch.opens[0].prompt_logprobs == []


def test_prompt_logprobs_over_two_chunks_reach_the_open_once():
    b = batcher()
    b.add(req("a", 5, prompt_logprobs=True))
    b.add(req("b", 2))
    p = b.plan(1)
    a, bb = p.seqs.tolist()
    # the shard fed a's prompt in two chunks (3 then 2 tokens); the first chunk samples nothing
    b.apply(result(1, [(bb, 6)], prompt=[(a, [math.nan, -1.0, -2.0])]))
    rows = b.apply(result(2, [(bb, 6), (a, 7)], prompt=[(a, [-3.0, -4.0])]))
    batch = wire(token_batch(0, rows))
    (open_a,) = [o for o in batch.opens if o.request_id == "a"]
    assert open_a.prompt_ids == [10, 11, 12, 13, 14]
    assert math.isnan(open_a.prompt_logprobs[0]) and open_a.prompt_logprobs[1:] == [-1.0, -2.0, -3.0, -4.0]
    (open_b,) = [o for o in batch.opens if o.request_id == "b"]
    assert open_b.prompt_ids == [] and open_b.prompt_logprobs == []  # b asked for none
    # later rows open nothing again, and a late prompt run is not gathered any more
    rows = b.apply(result(3, [(a, 8)], prompt=[(a, [-9.0])]))
    assert wire(token_batch(0, rows)).opens == []
    assert b.by_request["a"].prompt_logprobs == []


def test_missing_prompt_logprobs_are_nan():
    b = batcher()
    b.add(req("a", 3, prompt_logprobs=True))
    p = b.plan(1)
    rows = b.apply(result(1, [(int(p.seqs[0]), 7)], prompt=[(int(p.seqs[0]), [math.nan, -1.0])]))
    (o,) = token_batch(0, rows).opens
    assert o.prompt_ids == [10, 11, 12] and o.prompt_logprobs[1] == -1.0
    assert math.isnan(o.prompt_logprobs[0]) and math.isnan(o.prompt_logprobs[2])


def test_an_abort_before_the_first_token_still_opens_with_the_prompt():
    b = batcher()
    b.add(req("a", 3, prompt_logprobs=True))
    ended = b.finish("a")  # still waiting
    batch = wire(token_batch(0, [ended]))
    assert batch.finish.tolist() == [FINISH_ABORTED] and batch.opens[0].prompt_ids == [10, 11, 12]
