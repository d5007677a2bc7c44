"""The full per-row pipeline (processors, warpers, choice, top-n) on synthetic logits in mixed batches.

Each row is checked against transformers' own processors and warpers where they exist, and against a plain
transcription of the reference's formula where they do not (frequency penalty, watermark).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from libs.protocol.params import SamplingParams
from services.shard.sampling import sampler
from services.shard.sampling.penalties import WATERMARK_HASH_KEY
from services.shard.sampling.sampler import choose


def final_scores(logits, params, histories=None, **kw):
    """The sampler's final scores of every row, float32."""
    return sampler.final_scores(logits, params, histories, **kw)[0].float()


VOCAB = 64
GAMMA, DELTA = 0.25, 3.0


def _logits(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _histories(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # short alphabets so ids repeat (counts > 1) and some logits are negative where penalised
    return [rng.integers(0, VOCAB // 2, size=int(rng.integers(1, 40))) for _ in range(n)]


def _watermark_ref(row: torch.Tensor, prev: int) -> torch.Tensor:
    """TGI's watermark processor, step by step, for one row."""
    rng = torch.Generator()
    rng.manual_seed(15485863 * prev)
    green = torch.randperm(VOCAB, generator=rng)[: int(VOCAB * GAMMA)]
    out = row.clone()
    for t in green.tolist():
        out[t] += DELTA
    return out


def _frequency_ref(row: torch.Tensor, ids: np.ndarray, penalty: float) -> torch.Tensor:
    """TGI's frequency penalty: scores -= penalty * count(token) / len(input_ids), one token at a time."""
    out = row.clone()
    for t in range(VOCAB):
        out[t] -= penalty * (int((ids == t).sum()) / len(ids))
    return out


def _reference(row: torch.Tensor, ids: np.ndarray, p: SamplingParams) -> torch.Tensor:
    """TGI's order for one row: watermark, repetition, frequency; temperature, top-k, top-p, typical-p."""
    scores = row.clone()
    if p.watermark:
        scores = _watermark_ref(scores, int(ids[-1]))
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor(ids)[None], scores[None])[0]
    if p.frequency_penalty != 0.0:
        scores = _frequency_ref(scores, ids, p.frequency_penalty)
    chain = LogitsProcessorList()
    if p.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.typical_p < 1.0:
        chain.append(TypicalLogitsWarper(p.typical_p))
    return chain(None, scores[None])[0]


S = SamplingParams
MIXED = [
    S(),  # greedy, nothing else: untouched
    S(repetition_penalty=1.5),  # greedy with a penalty
    S(do_sample=True, repetition_penalty=0.7, seed=1),  # < 1 favours repeats
    S(frequency_penalty=0.8),
    S(frequency_penalty=-1.2, do_sample=True, seed=2),
    S(watermark=True),
    S(do_sample=True, typical_p=0.5, seed=3),
    S(do_sample=True, typical_p=0.2, seed=3),  # low mass: the most likely token itself may be atypical
    S(do_sample=True, typical_p=0.95, temperature=0.7, seed=4),
    S(do_sample=True, temperature=1.3, top_k=12, top_p=0.9, typical_p=0.8, seed=5),
    S(do_sample=True, watermark=True, repetition_penalty=1.3, frequency_penalty=0.5, top_k=20, typical_p=0.9),
    S(temperature=0.8, top_n_tokens=3),
]


def test_final_scores_match_transformers_and_the_reference_per_row():
    logits, hist = _logits(len(MIXED), scale=1.0), _histories(len(MIXED))  # flat enough for typical-p to cut
    got = final_scores(logits, MIXED, hist, watermark_gamma=GAMMA, watermark_delta=DELTA)
    assert not torch.equal(got, logits)  # really processed
    for i, p in enumerate(MIXED):
        want = _reference(logits[i], hist[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), f"row {i}: other tokens removed"
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5, msg=f"row {i} ({p})")


def test_the_callers_logits_are_not_modified():
    logits = _logits(3)
    before = logits.clone()
    params = [S(repetition_penalty=2.0), S(watermark=True), S(frequency_penalty=1.0)]
    final_scores(logits, params, _histories(3))
    assert torch.equal(logits, before)


def test_each_processor_acts_where_it_should():
    logits, ids = _logits(1, seed=7), np.array([3, 3, 5, 9, 3])
    for p in (S(repetition_penalty=2.0), S(frequency_penalty=1.0)):
        got = final_scores(logits, [p], [ids])[0]
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[ids] = True
        assert torch.equal(got[~seen], logits[0][~seen])  # unseen ids untouched
        assert (got[seen] < logits[0][seen]).all()  # seen ids less likely
    # frequency: 3 occurs three times in five ids, 5 once
    got = final_scores(logits, [S(frequency_penalty=1.0)], [ids])[0]
    torch.testing.assert_close(logits[0, 3] - got[3], torch.tensor(3 / 5))
    torch.testing.assert_close(logits[0, 5] - got[5], torch.tensor(1 / 5))


def test_watermark_greenlist_follows_the_previous_token():
    logits = torch.zeros(2, VOCAB)
    got = final_scores(logits, [S(watermark=True)] * 2, [np.array([4, 17]), np.array([17, 4])], watermark_gamma=GAMMA)
    for row, prev in zip(got, (17, 4)):
        green = row > 0
        assert int(green.sum()) == int(VOCAB * GAMMA)
        torch.testing.assert_close(row[green], torch.full((int(VOCAB * GAMMA),), 2.0))  # default delta
        gen = torch.Generator().manual_seed(WATERMARK_HASH_KEY * prev)
        assert set(green.nonzero()[:, 0].tolist()) == set(torch.randperm(VOCAB, generator=gen)[:16].tolist())
    assert not torch.equal(got[0], got[1])


def test_watermarked_draws_are_mostly_green():
    """Sampling on flat logits: the green-list fraction rises far above gamma (what the detector tests)."""
    gen, ids, green = torch.Generator().manual_seed(0), [5], 0
    p = S(do_sample=True, watermark=True)
    for _ in range(200):
        tok = int(choose(torch.zeros(1, VOCAB), [p], [gen], [np.array(ids)], watermark_gamma=GAMMA).token_ids[0])
        rng = torch.Generator().manual_seed(WATERMARK_HASH_KEY * ids[-1])
        green += tok in set(torch.randperm(VOCAB, generator=rng)[: int(VOCAB * GAMMA)].tolist())
        ids.append(tok)
    # with delta 2, a green token is e^2 more likely: P(green) = 0.25e^2 / (0.25e^2 + 0.75) ≈ 0.71
    assert green / 200 > 0.55


def test_choice_logprob_and_top_n_come_from_the_final_scores():
    params = [
        S(top_n_tokens=5),  # greedy with alternatives
        S(do_sample=True, top_k=3, top_n_tokens=5, seed=1),  # only 3 finite: 3 alternatives
        S(do_sample=True, repetition_penalty=1.4, top_n_tokens=2, seed=2),
        S(do_sample=True, seed=3),  # asks for none
        S(frequency_penalty=0.5, typical_p=0.7, top_n_tokens=4),
    ]
    logits, hist = _logits(len(params), seed=3), _histories(len(params), seed=3)
    gens = [torch.Generator().manual_seed(i) for i in range(len(params))]
    c = choose(logits, params, gens, hist)
    final = torch.log_softmax(final_scores(logits, params, hist), dim=-1)
    assert c.top_counts.tolist() == [5, 3, 2, 0, min(4, int(torch.isfinite(final[4]).sum()))]
    torch.testing.assert_close(c.logprobs, final.gather(-1, c.token_ids[:, None])[:, 0], rtol=0, atol=1e-5)
    assert c.token_ids[0] == final[0].argmax()  # greedy: the best alternative is the choice
    bounds = np.cumsum([0, *c.top_counts.tolist()])
    for i in range(len(params)):
        ids, lps = c.top_ids[bounds[i] : bounds[i + 1]], c.top_logprobs[bounds[i] : bounds[i + 1]]
        if len(ids) == 0:
            continue
        assert (lps[:-1] >= lps[1:]).all() and torch.isfinite(lps).all()  # best first, no removed token
        torch.testing.assert_close(lps, final[i, ids], rtol=0, atol=1e-5)
        torch.testing.assert_close(lps, final[i].topk(len(ids)).values, rtol=0, atol=1e-5)
        if int(c.token_ids[i]) in ids.tolist():  # the choice among its alternatives: the very same number
            assert lps[ids.tolist().index(int(c.token_ids[i]))] == c.logprobs[i]


def test_no_top_n_asked_leaves_alternatives_empty():
    c = choose(_logits(3), [S(), S(do_sample=True), S(repetition_penalty=1.2)], [None] * 3, _histories(3))
    assert c.top_counts is None and c.top_ids is None and c.top_logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_reports_log_softmax_at_argmax(dtype):
    logits = _logits(6, seed=4).to(dtype)
    c = choose(logits, [S()] * 6, [None] * 6)
    want = torch.log_softmax(logits.float(), dim=-1)
    assert c.token_ids.tolist() == want.argmax(-1).tolist()
    torch.testing.assert_close(c.logprobs, want.max(-1).values, rtol=0, atol=1e-5)


def test_typical_p_one_keeps_every_token():
    """A neutral row next to a typical-p row: float rounding of its cumulative mass must not cut its tail."""
    logits = _logits(2, seed=5, scale=6.0)
    got = final_scores(logits, [S(do_sample=True), S(do_sample=True, typical_p=0.3)])
    assert torch.equal(got[0], logits[0])
    assert torch.isinf(got[1]).any()
