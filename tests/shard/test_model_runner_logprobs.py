"""ModelRunner with the full sampling pipeline: prompt logprobs, penalties, watermark and top-n on the tiny models.

Prompt logprobs are checked against log_softmax of one plain transformers forward (eager, float32), whole and
chunked; penalised greedy output against transformers' generate(repetition_penalty=…); seeded penalised sampling
alone against the same request inside a busy batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from libs.protocol.params import SamplingParams
from services.shard.model_runner import ModelRunner
from tests.reference import _load, reference_generate
from tests.shard.driver import Request, drive
from tests.tiny_models import ARCHS, prompts_for

S = SamplingParams


def _reference_prompt_logprobs(model_dir, prompt: list[int]) -> list[float]:
    model = _load(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), use_cache=False).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    return [math.nan] + [float(lsm[j - 1, prompt[j]]) for j in range(1, len(prompt))]


class Recorder:
    """Collects what the runner reports per sequence over the steps of a drive."""

    def __init__(self) -> None:
        self.prompt_runs: dict[int, list[np.ndarray]] = {}
        self.top: dict[int, list[tuple[list[int], list[float]]]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.steps_with_top = 0
        self.decoding: set[int] = set()  # seqs that have sampled: their rows are decodes from now on

    def __call__(self, plan, result) -> None:
        fed = dict(zip(plan.seqs.tolist(), plan.num_tokens.tolist()))
        self.decoding -= {n.seq for n in plan.new}  # a reused handle starts over
        at = 0
        for seq, count in zip(result.prompt_seqs.tolist(), result.prompt_counts.tolist()):
            assert seq not in self.decoding, "a decode row reported prompt logprobs"
            assert count == fed[seq]  # one run per fed row, as long as the row
            self.prompt_runs.setdefault(seq, []).append(result.prompt_logprobs[at : at + count].copy())
            at += count
        for seq, lp in zip(result.seqs.tolist(), result.logprobs.tolist()):
            self.logprobs.setdefault(seq, []).append(lp)
        self.decoding |= set(result.seqs.tolist())
        if len(result.top_counts) == 0:
            return
        self.steps_with_top += 1
        bounds = np.cumsum([0, *result.top_counts.tolist()])
        for i, seq in enumerate(result.seqs.tolist()):
            ids = result.top_ids[bounds[i] : bounds[i + 1]].tolist()
            lps = result.top_logprobs[bounds[i] : bounds[i + 1]].tolist()
            self.top.setdefault(seq, []).append((ids, lps))


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_equal_a_plain_forward(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = prompts_for(model_dir)
    lp = S(prompt_logprobs=True)
    requests = [
        Request(prompts[2], 4, join=1, sampling=lp),  # whole prompt in one row
        Request(prompts[2], 4, join=1, chunk=7, sampling=lp),  # chunked: the carried row links the chunks
        Request(prompts[1], 6, join=1),  # no prompt logprobs, decodes alongside
        Request(prompts[4], 3, join=3, chunk=1, sampling=lp),  # one token per chunk, among decodes
        Request(prompts[0], 3, join=4, sampling=S(prompt_logprobs=True, do_sample=True, top_k=5, seed=3)),
    ]
    rec = Recorder()
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4)
    got = drive(runner, requests, on_result=rec)
    assert 2 not in rec.prompt_runs
    for seq, req in enumerate(requests):
        if not req.sampling.prompt_logprobs:
            continue
        runs = rec.prompt_runs[seq]
        assert len(runs) == -(-len(req.prompt) // (req.chunk or len(req.prompt)))  # prefill rows only
        have = np.concatenate(runs)
        want = np.array(_reference_prompt_logprobs(model_dir, req.prompt), dtype=np.float32)
        assert math.isnan(have[0]) and not np.isnan(have[1:]).any()
        np.testing.assert_allclose(have[1:], want[1:], rtol=0, atol=2e-4, err_msg=f"{arch} seq {seq}")
    # keeping more positions for the LM head does not disturb the choice
    for seq in (0, 1, 3):
        assert got[seq] == reference_generate(model_dir, requests[seq].prompt, requests[seq].max_new)
    assert rec.steps_with_top == 0  # nobody asked for alternatives: the frames stay empty


def _generate_penalised(model_dir, prompt: list[int], max_new: int, penalty: float) -> list[int]:
    model = _load(str(model_dir))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            repetition_penalty=penalty,
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_repetition_penalty_matches_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = prompts_for(model_dir)
    requests = [
        Request(prompts[1], 16, join=1, sampling=S(repetition_penalty=1.8)),
        Request(prompts[3], 16, join=2, chunk=5, sampling=S(repetition_penalty=1.3)),  # history across chunks
        Request(prompts[2], 12, join=1),  # unpenalised neighbour
        Request(prompts[4], 12, join=3, sampling=S(repetition_penalty=0.8)),
    ]
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=16)
    got = drive(runner, requests)
    for seq, req in enumerate(requests):
        want = _generate_penalised(model_dir, req.prompt, req.max_new, req.sampling.repetition_penalty)
        assert got[seq] == want, f"{arch} seq {seq}"
    # the penalty really changes the output (else the test proves nothing)
    assert got[0] != reference_generate(model_dir, requests[0].prompt, 16)


def test_seeded_penalised_sampling_is_the_same_alone_and_in_a_busy_batch(tiny_dirs):
    model_dir = tiny_dirs["qwen2"]
    prompts = prompts_for(model_dir)
    mine = S(
        do_sample=True,
        seed=1234,
        temperature=1.6,
        top_k=40,
        top_p=0.95,
        typical_p=0.97,
        repetition_penalty=1.3,
        frequency_penalty=0.6,
        watermark=True,
        top_n_tokens=3,
        prompt_logprobs=True,
    )
    target = Request(prompts[1], 14, join=1, chunk=9, sampling=mine)

    alone = Recorder()
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4, watermark_gamma=0.4, watermark_delta=1.5)
    got_alone = drive(runner, [target], on_result=alone)[0]

    busy = Recorder()
    others = [
        Request(prompts[2], 10, join=1),
        Request(prompts[0], 12, join=1, sampling=S(do_sample=True, seed=1234, repetition_penalty=1.3)),
        Request(prompts[3], 9, join=3, chunk=4, sampling=S(frequency_penalty=-0.5, top_n_tokens=5)),
        Request(prompts[4], 8, join=5, sampling=S(do_sample=True, watermark=True, seed=9, prompt_logprobs=True)),
        Request(prompts[5], 8, join=2, sampling=S(temperature=0.7, typical_p=0.5, seed=4)),
    ]
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4, watermark_gamma=0.4, watermark_delta=1.5)
    got_busy = drive(runner, [others[0], others[1], target, *others[2:]], on_result=busy)
    assert len(set(got_alone)) > 3  # really sampling
    assert got_busy[2] == got_alone
    np.testing.assert_allclose(busy.logprobs[2], alone.logprobs[0], rtol=0, atol=1e-4)
    assert [ids for ids, _ in busy.top[2]] == [ids for ids, _ in alone.top[0]]
    for ids, lps in alone.top[0]:
        assert len(ids) == 3 and lps == sorted(lps, reverse=True)
    np.testing.assert_allclose(
        np.concatenate(busy.prompt_runs[2]), np.concatenate(alone.prompt_runs[0]), rtol=0, atol=1e-4
    )
    # rows that asked for no alternatives get none, next to rows that did
    assert all(ids == [] for ids, _ in busy.top[0])
