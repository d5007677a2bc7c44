"""The greedy token at each prompt position (OpenAI completions' prompt `top_logprobs`): gathered over prefill
chunks beside the prompt logprobs and handed to the detokenizer once, on the StreamOpen."""

import math

import msgspec
import numpy as np

from libs.protocol.step_messages import StepResult
from services.scheduler.token_batch import token_batch
from tests.services.scheduler.test_details import batcher, req, result, wire


def with_greedy(r: StepResult, greedy: list[tuple[int, float]]) -> StepResult:
    """`r` with the greedy frames (one per prompt logprob, in feed order)."""
    ids = np.array([i for i, _ in greedy], np.int32)
    return wire(
        msgspec.structs.replace(
            r, prompt_greedy_ids=ids, prompt_greedy_logprobs=np.array([lp for _, lp in greedy], np.float32)
        )
    )


def test_greedy_over_two_chunks_reach_the_open():
    b = batcher()
    b.add(req("a", 4, prompt_logprobs=True))
    b.add(req("b", 2, prompt_logprobs=True))
    a, bb = b.plan(1).seqs.tolist()
    first = result(1, [(bb, 6)], prompt=[(a, [math.nan, -1.0]), (bb, [math.nan, -2.0])])
    b.apply(with_greedy(first, [(-1, math.nan), (30, -0.5), (-1, math.nan), (31, -0.25)]))
    rows = b.apply(with_greedy(result(2, [(bb, 6), (a, 7)], prompt=[(a, [-3.0, -4.0])]), [(32, -0.125), (33, -0.75)]))
    opens = {o.request_id: o for o in wire(token_batch(0, rows)).opens}
    o = opens["a"]
    assert o.prompt_greedy_ids == [-1, 30, 32, 33] and o.prompt_greedy_logprobs[1:] == [-0.5, -0.125, -0.75]
    assert math.isnan(o.prompt_greedy_logprobs[0])
    assert opens["b"].prompt_greedy_ids == [-1, 31]
    assert b.by_request["a"].prompt_greedy == []  # handed over once


def test_no_greedy_frames_means_none():
    b = batcher()
    b.add(req("a", 3, prompt_logprobs=True))
    (a,) = b.plan(1).seqs.tolist()
    rows = b.apply(result(1, [(a, 7)], prompt=[(a, [math.nan, -1.0, -2.0])]))
    (o,) = token_batch(0, rows).opens
    assert o.prompt_greedy_ids == [] and o.prompt_greedy_logprobs == [] and o.prompt_logprobs[1:] == [-1.0, -2.0]
