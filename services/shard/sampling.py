"""Token choice, in TGI's order: processors (watermark, penalties); the grammar mask (services.shard.constraints,
rows with a grammar only); warpers temperature, top-k, top-p, typical-p; then a seeded draw or argmax; then the
top-n alternatives.

Like TGI's `HeterogeneousNextTokenChooser`, a row samples when `do_sample` is set *or* any warper is active (a
request with only `temperature=0.7` samples), and the reported logprob is the log-softmax of the final processed
and warped scores at the chosen token; the alternatives come from that same distribution.

The warpers run on all rows at once (a neutral row is a no-op); only the draw is per row, because every request
owns its generator (same seed → same tokens, whatever else shares the batch). A batch where no row asks for
anything (all greedy, no penalties, no alternatives) skips the processors and warpers altogether.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from libs.protocol.params import SamplingParams
from services.shard.processors import apply_processors


def _has_warpers(p: SamplingParams) -> bool:
    return p.temperature != 1.0 or p.top_k > 0 or p.top_p < 1.0 or p.typical_p < 1.0


def samples(p: SamplingParams) -> bool:
    """Whether the row draws its token (TGI: do_sample, or any warper) rather than taking the argmax."""
    return p.do_sample or _has_warpers(p)


def _typical(scores: torch.Tensor, mass: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """HF/TGI's TypicalLogitsWarper per row: keep the tokens whose surprise is closest to the entropy."""
    normalized = torch.log_softmax(scores, dim=-1)
    probs = normalized.exp()
    entropy = -(normalized * probs).nansum(-1, keepdim=True)  # -inf * 0 = nan: removed tokens add nothing
    shifted = (-normalized - entropy).abs()
    sorted_shifted, order = torch.sort(shifted, dim=-1, descending=False)
    cum = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass[:, None]).sum(dim=1).clamp_(max=scores.shape[-1] - 1)
    sorted_remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    sorted_remove[:, 0] = False  # min_tokens_to_keep = 1
    sorted_remove &= active[:, None]  # mass 1.0 rows: float rounding must not cut them
    return scores.masked_fill(sorted_remove.scatter(1, order, sorted_remove), float("-inf"))


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's temperature, top-k, top-p, typical-p (HF/TGI warper semantics); removed tokens become -inf."""
    scores = logits.float()
    device = scores.device
    temperature = [p.temperature for p in params]
    if any(t != 1.0 for t in temperature):
        scores = scores / torch.tensor(temperature, dtype=torch.float32, device=device)[:, None]

    if any(p.top_k > 0 for p in params):
        # TopKLogitsWarper: drop scores strictly below the k-th largest (ties at the k-th survive)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        k = top_k.clamp(1, scores.shape[-1])
        kth = torch.topk(scores, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        scores = scores.masked_fill((scores < kth) & (top_k > 0)[:, None], float("-inf"))

    if any(p.top_p < 1.0 for p in params):
        # TopPLogitsWarper: ascending sort, drop the low tail whose cumulative mass is <= 1 - top_p,
        # always keeping the best token
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum <= (1.0 - top_p)[:, None]
        sorted_remove[:, -1] = False
        sorted_remove &= (top_p < 1.0)[:, None]
        scores = scores.masked_fill(sorted_remove.scatter(1, order, sorted_remove), float("-inf"))

    if any(p.typical_p < 1.0 for p in params):
        mass = torch.tensor([p.typical_p for p in params], dtype=torch.float32, device=device)
        scores = _typical(scores, mass, mass < 1.0)
    return scores


@dataclass
class Choice:
    """One step's choice for n rows, on the logits' device."""

    token_ids: torch.Tensor  # [n] long
    logprobs: torch.Tensor  # [n] float32, log-softmax of the final scores at the chosen token
    # alternatives, or None when no row asked for any: per row how many, then all rows' ids/logprobs, best first
    top_counts: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _top_n(logprobs: torch.Tensor, want: list[int]) -> tuple[torch.Tensor, ...]:
    """The best `want[i]` tokens of each row (plain top-n: TGI's reference names no tie rule), best first.

    Tokens a warper removed (-inf) are never alternatives: they cannot be drawn, and JSON has no -inf.
    """
    k = min(max(want), logprobs.shape[-1])
    values, ids = torch.topk(logprobs, k, dim=-1, sorted=True)
    n = torch.tensor(want, dtype=torch.long, device=logprobs.device)[:, None]
    valid = (torch.arange(k, device=logprobs.device)[None] < n) & torch.isfinite(values)
    return valid.sum(dim=1), ids[valid], values[valid]


def final_scores(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    histories: list[np.ndarray | None] | None = None,  # per row: token ids so far, for rows with processors
    *,
    watermark_gamma: float = 0.5,
    watermark_delta: float = 2.0,
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The scores a row's token is chosen from: processors, the grammar mask, then warpers (float32; `logits`
    itself when no row asks for any).

    `constrain` masks the scores in place after the processors (TGI's order); it may write into `logits` itself
    (the runner's own tensor, used for nothing else after the choice)."""
    scores = logits.float()
    if any(p.keeps_history() for p in params):
        if scores is logits:  # processors write in place: never into the caller's tensor
            scores = scores.clone()
        histories = histories or [None] * len(params)
        scores = apply_processors(scores, params, histories, gamma=watermark_gamma, delta=watermark_delta)
    if constrain is not None:
        constrain(scores)
    if any(_has_warpers(p) for p in params):
        scores = warp(scores, params)
    return scores


# Rows whose scores are reduced together in `_greedy`: about 4 MB of float32, so a chunk read once from memory stays
# in cache for the passes that follow.
GREEDY_CHUNK_ELEMENTS = 1 << 20


def _greedy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's argmax and its logprob (max − logsumexp) without a [rows, vocab] log-softmax.

    The log-softmax writes as much as it reads, and at a large vocabulary and batch (Gemma: 64 × 262k floats,
    64 MB) every pass over it goes to memory: this does max, subtract, exp and sum a few rows at a time, in
    cache (docs/benchmarks.md has the gain). `scores` may be bf16 logits: each chunk turns float32 in the buffer,
    so no float32 copy of them all is made. The argmax is `_first_argmax` (torch's CPU argmax and max(dim) run
    ~20x slower than amax). The logprobs are closer to float64's than float32's log-softmax is (~1e-7 against
    ~7e-5 at 262k tokens).
    """
    rows, vocab = scores.shape
    chunk = max(1, GREEDY_CHUNK_ELEMENTS // vocab)
    token_ids = torch.empty(rows, dtype=torch.long, device=scores.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=scores.device)
    buffer = torch.empty(min(chunk, rows), vocab, dtype=torch.float32, device=scores.device)
    for start in range(0, rows, chunk):
        part = buffer[: min(chunk, rows - start)]
        part.copy_(scores[start : start + chunk])
        token_ids[start : start + chunk] = _first_argmax(part)
        part.sub_(part.amax(dim=-1, keepdim=True)).exp_()
        logprobs[start : start + chunk] = -torch.log(part.sum(dim=-1))
    return token_ids, logprobs


# Width of the blocks `_first_argmax` reduces first.
ARGMAX_BLOCK = 128


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a [rows, vocab] tensor — the first maximal index, NaN counting as the maximum — as
    the amax of blocks of ARGMAX_BLOCK, then the argmax within each row's first block that holds its maximum."""
    rows, vocab = x.shape
    full = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    if full == 0:
        return x.argmax(dim=-1)
    block_max = x[:, :full].view(rows, -1, ARGMAX_BLOCK).amax(dim=-1)
    if full < vocab:
        block_max = torch.cat([block_max, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    where = block_max.argmax(dim=-1, keepdim=True) * ARGMAX_BLOCK + torch.arange(ARGMAX_BLOCK, device=x.device)
    where.clamp_(max=vocab - 1)  # the short last block repeats its last index: a later place, never chosen first
    return where.gather(1, x.gather(1, where).argmax(dim=-1, keepdim=True))[:, 0]


def choose(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[np.ndarray | None] | None = None,  # per row: token ids so far, for rows with processors
    *,
    watermark_gamma: float = 0.5,
    watermark_delta: float = 2.0,
    constrain: Callable[[torch.Tensor], None] | None = None,  # the grammar mask, see final_scores
) -> Choice:
    """Pick one token per row and report its logprob (and the alternatives asked for)."""
    n = logits.shape[0]
    device = logits.device
    if n == 0:
        return Choice(torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device))
    sampled = [samples(p) for p in params]
    want = [p.top_n_tokens for p in params]
    if not any(sampled) and max(want) == 0 and constrain is None and not any(p.keeps_history() for p in params):
        return Choice(*_greedy(logits))  # nothing changes the logits: straight from them (bf16 too), no copy first
    scores = final_scores(
        logits,
        params,
        histories,
        watermark_gamma=watermark_gamma,
        watermark_delta=watermark_delta,
        constrain=constrain,
    )
    if not any(sampled) and max(want) == 0:
        return Choice(*_greedy(scores))
    token_ids = torch.argmax(scores, dim=-1)  # greedy rows: argmax of the processed scores (TGI)
    for i, gen in enumerate(generators):
        if sampled[i]:
            token_ids[i] = torch.multinomial(torch.softmax(scores[i], dim=-1), num_samples=1, generator=gen)[0]
    logprobs = torch.log_softmax(scores, dim=-1)  # one tensor for the choice and its alternatives
    choice = Choice(token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0])
    if max(want) > 0:
        choice.top_counts, choice.top_ids, choice.top_logprobs = _top_n(logprobs, want)
    return choice


def sample(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [n] long, logprobs [n] float32) for rows without processors; see `choose`."""
    choice = choose(logits, params, generators)
    return choice.token_ids, choice.logprobs
