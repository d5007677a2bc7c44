"""ModelRunner with the full sampling pipeline: prompt logprobs, penalties, watermark and top-n on the tiny models,
driven by the in-process engine (bench/engine.py).

Prompt logprobs are checked against log_softmax of one plain transformers forward (eager, float32), whole and
chunked (chunks of many tokens and of one); penalised greedy output against transformers'
generate(repetition_penalty=…); seeded penalised sampling alone against the same request inside a busy batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.engine import Engine, request
from libs.protocol.step_messages import StepPlan, StepResult
from services.shard.model_runner import ModelRunner
from tests.reference import load_model, reference_generate
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import ARCHS, prompts_for


def reference_prompt_logprobs(model_dir, prompt: list[int]) -> list[float]:
    model = load_model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), use_cache=False).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    return [math.nan] + [float(lsm[j - 1, prompt[j]]) for j in range(1, len(prompt))]


class Recorder(Steps):
    """The steps, and each request's prompt logprobs as the runner reported them: one run per prompt row."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.prompt_runs: dict[str, list[np.ndarray]] = {}
        self.steps_with_top = 0

    def __call__(self, plan: StepPlan, result: StepResult) -> None:
        super().__call__(plan, result)
        rows = {r.rid: r for r in self.rows[-1]}
        at = 0
        for seq, count in zip(result.prompt_seqs.tolist(), result.prompt_counts.tolist()):
            row = rows[self.rid[seq]]
            assert row.prompt, "a decode row reported prompt logprobs"
            assert count == row.fed  # one run per fed row, as long as the row
            self.prompt_runs.setdefault(row.rid, []).append(result.prompt_logprobs[at : at + count].copy())
            at += count
        self.steps_with_top += len(result.top_counts) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_equal_a_plain_forward(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = prompts_for(model_dir)
    lp = dict(prompt_logprobs=True)
    arrivals = {
        0: [
            request("whole", prompts[2], 4, **lp),  # 58 tokens in one row
            request("chunked", prompts[2], 4, **lp),  # 7 tokens, then chunks: the carried row links them
            request("plain", prompts[1], 6),  # no prompt logprobs, decodes alongside
        ],
        2: [request("ones", prompts[4], 3, **lp)],
        3: [request("sampled", prompts[0], 3, **lp, do_sample=True, top_k=5, seed=3)],
    }
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4)
    # 65 prompt tokens a step, one while anything decodes: chunks of one token among decodes
    engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=65, max_prefill_tokens_while_decoding=1)
    rec = Recorder(engine)
    got = engine.run(arrivals)
    assert "plain" not in rec.prompt_runs
    for req in (r for reqs in arrivals.values() for r in reqs if r.sampling.prompt_logprobs):
        rid, prompt = req.request_id, req.input_ids.tolist()
        runs = rec.prompt_runs[rid]
        assert len(runs) == len(rec.chunks(rid))  # a run for every prompt row, none for decodes
        have = np.concatenate(runs)
        want = np.array(reference_prompt_logprobs(model_dir, prompt), dtype=np.float32)
        assert math.isnan(have[0]) and not np.isnan(have[1:]).any()
        np.testing.assert_allclose(have[1:], want[1:], rtol=0, atol=2e-4, err_msg=f"{arch} {rid}")
        np.testing.assert_allclose(got[rid].prompt_logprobs, want, rtol=0, atol=2e-4)  # as the scheduler gathered them
    assert rec.chunks("whole") == [len(prompts[2])] and len(rec.chunks("chunked")) > 2
    assert 1 in rec.chunks("ones") and rec.beside_decodes("ones")  # one-token chunks among decodes
    # keeping more positions for the LM head does not disturb the choice
    for rid in ("whole", "chunked", "ones"):
        req = next(r for reqs in arrivals.values() for r in reqs if r.request_id == rid)
        assert got[rid].tokens == reference_generate(model_dir, req.input_ids.tolist(), req.max_new_tokens)
    assert rec.steps_with_top == 0  # nobody asked for alternatives: the frames stay empty


def _generate_penalised(model_dir, prompt: list[int], max_new: int, penalty: float) -> list[int]:
    model = load_model(str(model_dir))
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
    arrivals = {
        0: [request("1.8", prompts[1], 16, repetition_penalty=1.8), request("none", prompts[2], 12)],
        1: [request("1.3", prompts[3], 16, repetition_penalty=1.3)],  # chunks of 5: the history across chunks
        2: [request("0.8", prompts[4], 12, repetition_penalty=0.8)],
    }
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=16)
    engine = Engine.build(runner, model_dir, max_prefill_tokens_while_decoding=5)
    steps = Steps(engine)
    got = engine.run(arrivals)
    assert len(steps.chunks("1.3")) > 2 and len(steps.chunks("0.8")) > 2
    for req in (r for reqs in arrivals.values() for r in reqs):
        prompt, penalty = req.input_ids.tolist(), req.sampling.repetition_penalty
        want = _generate_penalised(model_dir, prompt, req.max_new_tokens, penalty)
        assert got[req.request_id].tokens == want, f"{arch} penalty {req.request_id}"
    # the penalty really changes the output (else the test proves nothing)
    assert got["1.8"].tokens != reference_generate(model_dir, prompts[1], 16)


def test_seeded_penalised_sampling_is_the_same_alone_and_in_a_busy_batch(tiny_dirs):
    model_dir = tiny_dirs["qwen2"]
    prompts = prompts_for(model_dir)
    mine = dict(
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

    def run(arrivals: dict, **budget) -> tuple[dict, Recorder]:
        runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4, watermark_gamma=0.4, watermark_delta=1.5)
        engine = Engine.build(runner, model_dir, **budget)
        rec = Recorder(engine)
        return engine.run(arrivals), rec

    target = request("mine", prompts[1], 14, **mine)
    alone, alone_rec = run({0: [target]}, max_batch_prefill_tokens=9)  # chunks of 9
    penalised = dict(do_sample=True, seed=1234, repetition_penalty=1.3)
    busy_arrivals = {
        0: [request("plain", prompts[2], 10), request("o1", prompts[0], 12, **penalised), target],
        1: [request("o5", prompts[5], 8, temperature=0.7, typical_p=0.5, seed=4)],
        2: [request("o3", prompts[3], 9, frequency_penalty=-0.5, top_n_tokens=5)],
        4: [request("o4", prompts[4], 8, do_sample=True, watermark=True, seed=9, prompt_logprobs=True)],
    }
    # the first two prompts and 9 tokens of mine in the first step; then chunks of 9 beside the decodes
    busy, busy_rec = run(busy_arrivals, max_batch_prefill_tokens=72, max_prefill_tokens_while_decoding=9)
    assert len(alone_rec.chunks("mine")) > 1 and len(busy_rec.chunks("mine")) > 1 and busy_rec.beside_decodes("mine")
    assert len(set(alone["mine"].tokens)) > 3  # really sampling
    assert busy["mine"].tokens == alone["mine"].tokens
    np.testing.assert_allclose(busy["mine"].logprobs, alone["mine"].logprobs, rtol=0, atol=1e-4)
    assert [ids for ids, _ in busy["mine"].top] == [ids for ids, _ in alone["mine"].top]
    for ids, lps in alone["mine"].top:
        assert len(ids) == 3 and lps == sorted(lps, reverse=True)
    np.testing.assert_allclose(
        np.concatenate(busy_rec.prompt_runs["mine"]), np.concatenate(alone_rec.prompt_runs["mine"]), rtol=0, atol=1e-4
    )
    # rows that asked for no alternatives get none, next to rows that did
    assert all(ids == [] for ids, _ in busy["plain"].top)
