"""Sampling in TGI's order, checked on synthetic logits against transformers' own logits warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from libs.protocol.params import SamplingParams
from services.shard.sampling import warpers
from services.shard.sampling.sampler import choose, final_scores

VOCAB = 64


def sample(logits, params, generators):
    c = choose(logits, params, generators)
    return c.token_ids, c.logprobs


def warp(logits, params):
    """The warpers on a copy of float32 logits, as the sampler runs them."""
    return warpers.warp(logits.clone(), params, in_place=True)


def _logits(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _draws(logits, params, seed, steps=30):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return torch.stack([sample(logits, params, gens)[0] for _ in range(steps)], dim=1)  # [rows, steps]


def _hf_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """TGI's warper chain, built from transformers' warpers (temperature, top-k, top-p), for one row."""
    chain = LogitsProcessorList()
    if p.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    return chain(None, row[None].clone())[0]


MIXED = [
    SamplingParams(),  # greedy
    SamplingParams(do_sample=True, seed=1),
    SamplingParams(do_sample=True, temperature=0.5, seed=2),
    SamplingParams(do_sample=True, top_k=5, seed=3),
    SamplingParams(do_sample=True, top_p=0.6, seed=4),
    SamplingParams(do_sample=True, temperature=1.7, top_k=10, top_p=0.8, seed=5),
    SamplingParams(temperature=0.8),  # a warper alone samples, as in TGI
]


def test_warp_matches_transformers_warpers_per_row():
    logits = _logits(len(MIXED))
    warped = warp(logits, MIXED)  # all rows at once: no row may leak into another
    for i, p in enumerate(MIXED):
        torch.testing.assert_close(warped[i], _hf_warp(logits[i], p), rtol=0, atol=1e-6)


def test_logprobs_are_log_softmax_of_warped_scores():
    logits = _logits(len(MIXED), seed=1)
    gens = [torch.Generator().manual_seed(i) for i in range(len(MIXED))]
    ids, logprobs = sample(logits, MIXED, gens)
    assert ids.dtype == torch.long and logprobs.dtype == torch.float32
    assert (logprobs <= 0).all()
    for i, p in enumerate(MIXED):
        want = torch.log_softmax(_hf_warp(logits[i], p), dim=-1)[ids[i]]
        assert torch.isfinite(want)  # the chosen token survived the warpers
        torch.testing.assert_close(logprobs[i], want, rtol=0, atol=1e-5)


def test_greedy_is_argmax_of_raw_logits():
    logits = _logits(8, seed=2)
    params = [SamplingParams() for _ in range(8)]
    ids, logprobs = sample(logits, params, [None] * 8)
    assert ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = _logits(1, scale=0.5)  # flat-ish: draws vary
    params = [SamplingParams(do_sample=True, seed=0)]
    a, b, c = _draws(logits, params, 11), _draws(logits, params, 11), _draws(logits, params, 12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len(set(a[0].tolist())) > 1  # really sampling, not argmax


def test_top_k_1_equals_greedy():
    logits = _logits(6, seed=3)
    params = [SamplingParams(do_sample=True, top_k=1, seed=i) for i in range(6)]
    ids, logprobs = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(6)])
    assert ids.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(logprobs, torch.zeros(6))  # one token left: probability 1


def test_draws_stay_inside_top_k_and_top_p():
    logits = _logits(2, seed=4)
    params = [SamplingParams(do_sample=True, top_k=3), SamplingParams(do_sample=True, top_p=0.5)]
    draws = _draws(logits, params, 0, steps=200)
    assert set(draws[0].tolist()) <= set(logits[0].topk(3).indices.tolist())
    probs = logits[1].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1]  # smallest set with mass >= 0.5
    assert set(draws[1].tolist()) <= set(nucleus.tolist())
    assert len(set(draws[1].tolist())) > 1


def test_temperature_and_top_p_change_the_distribution():
    logits = _logits(1, seed=5)

    def entropy(p: SamplingParams) -> float:
        probs = warp(logits, [p]).softmax(-1)
        return float(-(probs * probs.clamp_min(1e-30).log()).sum())

    cold, base, hot = (entropy(SamplingParams(do_sample=True, temperature=t)) for t in (0.5, 1.0, 2.0))
    assert cold < base < hot
    kept = torch.isfinite(warp(logits, [SamplingParams(do_sample=True, top_p=0.7)])).sum()
    assert 1 <= kept < VOCAB
    assert entropy(SamplingParams(do_sample=True, top_p=0.7)) < base


def test_a_warper_without_do_sample_samples():
    logits = _logits(1, scale=0.5)
    draws = _draws(logits, [SamplingParams(temperature=0.9)], 0, steps=30)
    assert len(set(draws[0].tolist())) > 1


@pytest.mark.parametrize("n", [0, 1])
def test_small_batches(n):
    ids, logprobs = sample(_logits(n), [SamplingParams()] * n, [None] * n)
    assert ids.shape == logprobs.shape == (n,)


def test_warpers_and_alternatives_run_on_the_rows_that_ask(monkeypatch):
    """In a mixed batch the warpers see only the rows with a warper and the top-n search only the rows asking for
    alternatives; the neutral rows stay bit for bit, the caller's float32 logits untouched."""
    warped_rows, searched = [], []
    real_warp_all, real_topk = warpers.warp_all, torch.topk
    monkeypatch.setattr(warpers, "warp_all", lambda s, p: warped_rows.append(len(p)) or real_warp_all(s, p))
    monkeypatch.setattr(torch, "topk", lambda x, k, **kw: searched.append(x.shape[0]) or real_topk(x, k, **kw))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=7, seed=1),
        SamplingParams(top_n_tokens=2),
        SamplingParams(do_sample=True, seed=2),
    ]
    logits = _logits(4, seed=8)
    before = logits.clone()
    scores, _ = final_scores(logits, params)
    assert warped_rows == [1] and torch.equal(logits, before)
    assert torch.equal(scores[[0, 2, 3]], logits[[0, 2, 3]])
    torch.testing.assert_close(scores[1], _hf_warp(logits[1], params[1]), rtol=0, atol=1e-6)
    c = choose(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    assert c.top_counts.tolist() == [0, 0, 2, 0] and 1 in searched and 4 not in searched
    assert c.top_ids.tolist() == logits[2].topk(2).indices.tolist()
