"""The scheduler's stop rules for vLLM's parameters: ignore_eos (EOS is an ordinary token), stop_token_ids (any of
them ends the request as EOS does), min_tokens (neither ends it before that many tokens); length still comes first."""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import FINISH_EOS, FINISH_LENGTH, FINISH_NONE
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from services.scheduler.batcher import Batcher

from .test_batcher import result

EOS = 2


def run(sampling: SamplingParams, tokens: list[int], max_new: int = 10) -> list[tuple[int, int]]:
    """Feed `tokens` one step each; the (token, finish) rows until the request ends."""
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids={EOS})
    ids = np.arange(10, 14, dtype=np.int32)
    b.add(Req(request_id="a", ingress=0, input_ids=ids, sampling=sampling, max_new_tokens=max_new))
    out = []
    for step, token in enumerate(tokens, 1):
        plan = b.plan(step)
        (row,) = b.apply(result(plan, {int(plan.seqs[0]): token}))
        out.append((row.token_id, row.finish))
        if row.finish:
            break
    return out


def test_eos_ends_by_default():
    assert run(SamplingParams(), [5, EOS, 6]) == [(5, FINISH_NONE), (EOS, FINISH_EOS)]


def test_ignore_eos_runs_to_max_tokens():
    rows = run(SamplingParams(ignore_eos=True), [EOS, 5, EOS], max_new=3)
    assert rows == [(EOS, FINISH_NONE), (5, FINISH_NONE), (EOS, FINISH_LENGTH)]


def test_stop_token_ids_end_as_eos():
    assert run(SamplingParams(stop_token_ids=[7, 8]), [5, 8, 6]) == [(5, FINISH_NONE), (8, FINISH_EOS)]
    # with ignore_eos, a stop id still ends it, EOS does not
    rows = run(SamplingParams(ignore_eos=True, stop_token_ids=[7]), [EOS, 7])
    assert rows == [(EOS, FINISH_NONE), (7, FINISH_EOS)]


def test_min_tokens_holds_eos_and_stop_ids_back():
    rows = run(SamplingParams(min_tokens=2, stop_token_ids=[7]), [EOS, 7, EOS])
    assert rows == [(EOS, FINISH_NONE), (7, FINISH_NONE), (EOS, FINISH_EOS)]
    assert run(SamplingParams(min_tokens=2, stop_token_ids=[7]), [5, 5, 7]) == [
        (5, FINISH_NONE),
        (5, FINISH_NONE),
        (7, FINISH_EOS),
    ]


def test_length_first():
    assert run(SamplingParams(stop_token_ids=[7]), [7], max_new=1) == [(7, FINISH_LENGTH)]
