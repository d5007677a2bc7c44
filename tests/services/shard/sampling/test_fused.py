"""The choice by the C++ kernel (services/shard/sampling/fused.py, cpu_kernels/sampling.cpp) against the stages: the
first argmax and the max exactly as torch (ties across and within the kernel's parts of a row, NaN rows, masked
rows), logsumexp − max within float32 rounding of float64, temperatures divided as torch divides; draws that invert
the running sum of the weights at the generator's number, never a token of zero weight, the stages' tokens at the
same numbers; the batches the kernel does not take keep the stages; through a bf16 runner, seeded draws that do not
depend on the batch."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, request
from libs.protocol.params import SamplingParams
from services.shard import cpu_kernels
from services.shard.model_runner import ModelRunner
from services.shard.sampling import counter, fused, sampler
from services.shard.sampling.draws import draws
from services.shard.sampling.reduction import reduce
from tests.tiny_models import prompts_for

ops = torch.ops.switchyard_cpu
VOCAB = 40_000  # three of the kernel's parts of 16,384 tokens, the last one short


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_kernels.load(), cpu_kernels.reason()


def _logits(rows: int, vocab: int = VOCAB, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divide", [False, True])
def test_reduce_rows_gives_the_first_argmax_the_max_and_the_spread(dtype, divide):
    x = _logits(6, dtype=dtype)
    x[0, 20_000] = x[0, 35_000] = 40.0  # a tie across parts: the first
    x[1, 100] = x[1, 101] = x[1, 30_000] = 40.0  # a tie within a part
    x[2, -1] = 40.0  # the last token of a short last part
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.25, 2.0]) if divide else torch.ones(6)
    scores = x.float() / temps[:, None]  # torch's division, what the stages warp to
    ids, maxes, spreads = ops.reduce_rows(x, temps if divide else torch.empty(0))
    assert ids.tolist()[:3] == [20_000, 100, VOCAB - 1]
    assert torch.equal(ids, scores.argmax(-1)) and torch.equal(maxes, scores.amax(-1))
    lse = torch.logsumexp(scores.double(), -1) - scores.double().amax(-1)
    assert (spreads.double() - lse).abs().max() < 2e-6
    # the stages' reduction agrees: same tokens and maxes, spreads within float32 rounding
    s_ids, s_maxes, s_spreads = reduce(scores)
    assert torch.equal(ids, s_ids) and torch.equal(maxes, s_maxes) and (spreads - s_spreads).abs().max() < 2e-6


def test_nan_and_fully_masked_rows_as_torch():
    x = _logits(3, dtype=torch.float32)
    x[0, 30_000] = x[0, 35_000] = float("nan")
    x[1] = float("-inf")
    x[2, 5] = float("inf")
    ids, maxes, spreads = ops.reduce_rows(x.bfloat16(), torch.empty(0))
    want = x.bfloat16().float()
    assert ids.tolist() == want.argmax(-1).tolist() == [30_000, 0, 5]
    assert maxes[0].isnan() and maxes[1] == float("-inf") and maxes[2] == float("inf")
    assert spreads.isnan().all()  # as the softmax of such a row


def _weights(x: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    scores = x.float() / temps[:, None]
    return (scores.double() - scores.amax(-1, keepdim=True).double()).exp()


@pytest.mark.parametrize("vocab", [3_000, VOCAB])
def test_draw_rows_inverts_the_running_sum_at_the_generators_number(vocab):
    rows = 48
    x = _logits(rows, vocab, seed=1)
    temps = torch.linspace(0.3, 1.6, rows)
    _, maxes, _ = ops.reduce_rows(x, temps)
    gens = [torch.Generator().manual_seed(7 + r) for r in range(rows)]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens])
    got = ops.draw_rows(x, torch.arange(rows), temps, maxes, u)
    cum = _weights(x, temps).cumsum(-1)
    target = u * cum[:, -1]
    before = torch.where(got > 0, cum.gather(1, (got - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    at = cum.gather(1, got[:, None])[:, 0]
    tol = 1e-5 * cum[:, -1]
    assert (before <= target + tol).all() and (at >= target - tol).all()
    # the stages draw from the same numbers (their generators anew): the same tokens
    scores = x.float() / temps[:, None]
    stages = draws(scores, list(range(rows)), [torch.Generator().manual_seed(7 + r) for r in range(rows)])
    assert (stages == got).float().mean() >= 0.98


def test_draw_rows_never_takes_a_token_of_zero_weight():
    x = torch.full((4, VOCAB), float("-inf"))
    allowed = torch.tensor([3, 16_383, 16_384, VOCAB - 1])
    x[:, allowed] = torch.tensor([0.0, 1.0, -2.0, 0.5])
    x = x.bfloat16()
    _, maxes, _ = ops.reduce_rows(x, torch.empty(0))
    for u in (0.0, 1e-12, 0.5, 1 - 2.0**-53):
        got = ops.draw_rows(x, torch.arange(4), torch.empty(0), maxes, torch.full((4,), u, dtype=torch.float64))
        assert torch.isin(got, allowed).all(), (u, got)


def _gens(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]


def test_choose_by_the_kernel_is_the_stages_choice():
    params = [
        SamplingParams(),
        SamplingParams(top_n_tokens=3),
        SamplingParams(do_sample=True, temperature=0.7, seed=11),
        SamplingParams(do_sample=True, seed=12),
        SamplingParams(temperature=1.5, seed=13),  # a warper alone samples (TGI)
        SamplingParams(),
    ]
    x = _logits(len(params), seed=2)
    before = fused.batches
    got = sampler.choose(x, params, _gens(params), kernels=True)
    assert fused.batches == before + 1
    want = sampler.choose(x, params, _gens(params))
    assert fused.batches == before + 1  # without kernels: the stages
    assert torch.equal(got.token_ids, want.token_ids)
    assert (got.logprobs - want.logprobs).abs().max() < 1e-5
    assert torch.equal(got.top_counts, want.top_counts) and torch.equal(got.top_ids, want.top_ids)
    assert (got.top_logprobs - want.top_logprobs).abs().max() < 1e-5


@pytest.mark.parametrize(
    "odd",
    [
        SamplingParams(do_sample=True, top_k=5, seed=1),
        SamplingParams(do_sample=True, top_p=0.9, seed=1),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(logit_bias={5: 3.0}),
        SamplingParams(temperature=0.5, top_n_tokens=2, seed=1),  # alternatives of warped scores
    ],
    ids=["top-k", "top-p", "penalty", "bias", "warped alternatives"],
)
def test_what_the_kernel_does_not_do_keeps_the_stages(odd):
    params = [SamplingParams(), odd]
    x = _logits(2, seed=3)
    histories = [None, torch.arange(10).numpy()] if odd.keeps_history() else None
    before = fused.batches
    got = sampler.choose(x, params, _gens(params), histories, kernels=True)
    assert fused.batches == before and not fused.takes(params)
    want = sampler.choose(x, params, _gens(params), histories)
    assert torch.equal(got.token_ids, want.token_ids)


def test_a_grammar_or_counter_keys_keep_the_stages():
    params = [SamplingParams(do_sample=True, seed=4)] * 2
    x = _logits(2, seed=4)
    before = fused.batches
    keys = counter.DrawKeys.of([4, 4], [0, 1], torch.device("cpu"))
    sampler.choose(x, params, _gens(params), keys=keys, kernels=True)
    sampler.choose(x, params, _gens(params), constrain=lambda s: None, kernels=True)
    assert fused.batches == before


def test_a_bf16_runner_draws_the_same_tokens_alone_and_in_a_batch(tiny_dirs):
    """Through the engine: each sampled request's tokens depend on its seed alone, with the kernel choosing."""
    model_dir = tiny_dirs["llama"]
    # prompts of one length: the grouped prefill pads a row's keys to its group's longest, and in bf16 a padded
    # reduction may round otherwise on some CPUs (AMX) — the forward's batch dependence, not the draws' under test
    prompts = [p[:17] for p in prompts_for(model_dir)[1:4]]

    def run(ids: list[int]) -> dict:
        runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4, dtype=torch.bfloat16, cpu_kernels=True)
        assert runner.cpu_kernels
        reqs = [request(f"r{i}", prompts[i], 10, do_sample=True, temperature=0.8, seed=100 + i) for i in ids]
        return {k: v.tokens for k, v in Engine.build(runner, model_dir).run({0: reqs}).items()}

    before = fused.batches
    together = run([0, 1, 2])
    assert fused.batches > before
    alone = {}
    for i in range(3):
        alone.update(run([i]))
    assert together == alone
    assert len({tuple(t) for t in together.values()}) == 3
