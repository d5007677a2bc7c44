"""Token choice, in TGI's order: processors (watermark, penalties); the grammar mask (services.shard.constraints,
rows with a grammar only); warpers temperature, top-k, top-p, typical-p; then a seeded draw or argmax; then the
top-n alternatives.

Like TGI's `HeterogeneousNextTokenChooser`, a row samples when `do_sample` is set *or* any warper is active (a
request with only `temperature=0.7` samples), and the reported logprob is the log-softmax of the final processed
and warped scores at the chosen token; the alternatives come from that same distribution.

The warpers run at once on the rows that have any; only the draw is per row, because every request owns its
generator (same seed → same tokens, whatever else shares the batch; on CPU the rows are drawn side by side). A
batch where no row changes its scores (no penalties, grammar or warpers) skips the processors and warpers
altogether and reads the logits as they come (bf16 too: no float32 copy of them all). The argmax and every logprob
come from one chunked pass over the scores (`_reduce`); no [rows, vocab] log-softmax is written
(`python -m launcher.bench.sampling` times it). A greedy row whose grammar allows few tokens is chosen among those
alone and left out of that pass (`_choose_sparse`; docs/structured-output.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    """Each row's temperature, top-k, top-p, typical-p (HF/TGI warper semantics); removed tokens become -inf.
    `logits` itself is left as it is."""
    scores = logits.float()
    return _warp_rows(scores, params, in_place=scores is not logits)


def _warp_rows(scores: torch.Tensor, params: list[SamplingParams], *, in_place: bool) -> torch.Tensor:
    """`warp` of float32 scores, run on the rows that have a warper only (each warper is per row, so a row's result
    is the same whatever shares the batch): neutral rows in a mixed batch cost no division, top-k or sort.
    `in_place`: the scores are the caller's own copy and may take the warped rows."""
    active = [i for i, p in enumerate(params) if _has_warpers(p)]
    if len(active) == len(params):
        return _warp_all(scores, params)
    if not active:
        return scores
    rows = torch.tensor(active, device=scores.device)
    warped = _warp_all(scores.index_select(0, rows), [params[i] for i in active])
    return (scores if in_place else scores.clone()).index_copy_(0, rows, warped)


def _warp_all(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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


def _top_n(
    scores: torch.Tensor, maxes: torch.Tensor, spreads: torch.Tensor, want: list[int]
) -> tuple[torch.Tensor, ...]:
    """The best `want[i]` tokens of each row (plain top-n: TGI's reference names no tie rule), best first, with
    their logprobs computed as the choice's are (so a chosen token among them has the very same number); only the
    rows that ask for some are searched.

    Tokens a warper removed (-inf) are never alternatives: they cannot be drawn, and JSON has no -inf.
    """
    device = scores.device
    asked = [i for i, w in enumerate(want) if w > 0]
    if len(asked) < len(want):
        rows = torch.tensor(asked, device=device)
        scores, maxes, spreads = scores.index_select(0, rows), maxes[rows], spreads[rows]
    k = min(max(want), scores.shape[-1])
    values, ids = torch.topk(scores, k, dim=-1, sorted=True)
    values = (values.float() - maxes[:, None]) - spreads[:, None]
    n = torch.tensor([want[i] for i in asked], dtype=torch.long, device=device)[:, None]
    valid = (torch.arange(k, device=device)[None] < n) & torch.isfinite(values)
    counts = torch.zeros(len(want), dtype=torch.long, device=device)
    counts[asked] = valid.sum(dim=1)
    return counts, ids[valid], values[valid]


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
    scores, _ = _final_scores(logits, params, histories, watermark_gamma, watermark_delta, constrain)
    return scores.float()


def _final_scores(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[np.ndarray | None] | None,
    watermark_gamma: float,
    watermark_delta: float,
    constrain: Callable[[torch.Tensor], None] | None,
    sparse_ok: list[int] | None = None,
) -> tuple[torch.Tensor, dict[int, np.ndarray]]:
    """`final_scores`, in the logits' own dtype where only the grammar mask changes them (masking bf16 in place
    writes -inf and keeps the rest bit for bit: float32 of it is float32-then-masked, without a [rows, vocab]
    float32 copy). With `sparse_ok` and a mask that can split (constraints.GrammarMask), those rows that allow few
    tokens are left unmasked and their allowed ids returned ({row: ids}): the caller chooses among them alone."""
    scores, sparse = logits, {}
    if any(p.keeps_history() for p in params):
        scores = logits.float()
        if scores is logits:  # processors write in place: never into the caller's tensor
            scores = scores.clone()
        histories = histories or [None] * len(params)
        scores = apply_processors(scores, params, histories, gamma=watermark_gamma, delta=watermark_delta)
    if constrain is not None:
        split = getattr(constrain, "split", None)
        if split is not None and sparse_ok:
            sparse = split(scores, sparse_ok)
        else:
            constrain(scores)
    if any(_has_warpers(p) for p in params):
        warped = scores.float()
        scores = _warp_rows(warped, params, in_place=warped is not logits)
    return scores, sparse


def _choose_sparse(
    scores: torch.Tensor,
    sparse: dict[int, np.ndarray],
    token_ids: torch.Tensor,
    maxes: torch.Tensor,
    spreads: torch.Tensor,
) -> None:
    """`_reduce`'s results for greedy rows whose grammar allows only `sparse[row]` (ascending ids), read from those
    scores alone: the first argmax, the max and logsumexp − max over the allowed set (float64, then float32), which
    is what the masked row (-inf elsewhere, exp(-inf) = 0) gives."""
    rows = list(sparse)
    counts = [len(sparse[r]) for r in rows]
    ids = np.concatenate([sparse[r] for r in rows])
    at = torch.from_numpy(np.repeat(np.asarray(rows, dtype=np.int64), counts))
    values = scores[at, torch.from_numpy(ids)].double().numpy()
    chosen, tops, lses = [], [], []
    start = 0
    for count in counts:
        part = values[start : start + count]
        k = int(np.argmax(part))  # the first maximum (NaN first, as torch.argmax)
        top = part[k]
        chosen.append(ids[start + k])
        tops.append(top)
        lses.append(np.log(np.exp(part - top).sum()))
        start += count
    where = torch.tensor(rows, dtype=torch.long)
    token_ids[where] = torch.tensor(chosen, dtype=torch.long)
    maxes[where] = torch.tensor(tops, dtype=torch.float64).float()
    spreads[where] = torch.tensor(lses, dtype=torch.float64).float()


# Rows whose scores are reduced together in `_reduce`: about 4 MB of float32, so a chunk read once from memory stays
# in cache for the passes that follow.
GREEDY_CHUNK_ELEMENTS = 1 << 20


def _reduce(scores: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the first argmax, the max (float32) and logsumexp − max (float32), without a [rows, vocab]
    log-softmax; any row's logprob at token t is then (scores[t] − max) − that spread.

    The log-softmax writes as much as it reads, and at a large vocabulary and batch (Gemma: 64 × 262k floats, 64 MB)
    every pass over it goes to memory: this works a few rows at a time, in cache. bf16 scores turn float32 one chunk
    at a time in a buffer (no float32 copy of them all). Per chunk: the blockwise argmax (`_block_argmax`; torch's
    CPU argmax runs ~20x slower than amax), then torch's softmax kernel, written over the buffer, whose fused
    exp-and-sum costs about half of an `exp_` and a `sum` apart. Its own sum is a plain float32 running sum (~1e-5
    off at 262k tokens), so the spread is taken as −log p(argmax) + log Σp with Σp summed again by torch.sum's
    cascade: p(argmax) is exactly 1/(the kernel's sum), and the result is within ~3e-7 of float64.

    `rows`: only these rows are reduced (the others' entries are left unset, for the caller to fill).
    """
    n, vocab = scores.shape
    chunk = max(1, GREEDY_CHUNK_ELEMENTS // vocab)
    device = scores.device
    token_ids = torch.empty(n, dtype=torch.long, device=device)
    maxes = torch.empty(n, dtype=torch.float32, device=device)
    spreads = torch.empty(n, dtype=torch.float32, device=device)
    todo = list(range(n)) if rows is None else rows
    if not todo:
        return token_ids, maxes, spreads
    buffer = torch.empty(min(chunk, len(todo)), vocab, dtype=torch.float32, device=device)
    for start in range(0, len(todo), chunk):
        first, last = todo[start], todo[min(start + chunk, len(todo)) - 1]
        if last - first + 1 == min(chunk, len(todo) - start):  # consecutive rows: a view, no gather
            where = slice(first, last + 1)
        else:
            where = torch.tensor(todo[start : start + chunk], dtype=torch.long, device=device)
        src = scores[where]
        part = buffer[: src.shape[0]]
        if src.dtype != torch.float32 or not src.is_contiguous():
            src = part.copy_(src)
        ids, top = _block_argmax(src)
        token_ids[where], maxes[where] = ids, top
        probs = torch.softmax(src, dim=-1, out=part)  # in place where src is the buffer: row by row, read first
        spreads[where] = probs.sum(dim=-1).log_() - probs.gather(1, ids[:, None])[:, 0].log_()
    return token_ids, maxes, spreads


# Width of the blocks `_block_argmax` reduces first.
ARGMAX_BLOCK = 128


def _block_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch.argmax(x, -1), x.amax(-1)) of a [rows, vocab] tensor — the first maximal index, NaN counting as the
    maximum — as the amax of blocks of ARGMAX_BLOCK, then the argmax within each row's first block that holds its
    maximum."""
    rows, vocab = x.shape
    full = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    if full == 0:
        return x.argmax(dim=-1), x.amax(dim=-1).float()
    block_max = x[:, :full].view(rows, -1, ARGMAX_BLOCK).amax(dim=-1)
    if full < vocab:
        block_max = torch.cat([block_max, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    where = block_max.argmax(dim=-1, keepdim=True) * ARGMAX_BLOCK + torch.arange(ARGMAX_BLOCK, device=x.device)
    where.clamp_(max=vocab - 1)  # the short last block repeats its last index: a later place, never chosen first
    ids = where.gather(1, x.gather(1, where).argmax(dim=-1, keepdim=True))[:, 0]
    return ids, block_max.amax(dim=-1).float()


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a [rows, vocab] tensor, by blocks (see `_block_argmax`)."""
    return _block_argmax(x)[0]


def _draw(row: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A seeded draw from the softmax of one row's scores (float32, as the whole batch's float copy gave it)."""
    return torch.multinomial(torch.softmax(row.float(), dim=-1), num_samples=1, generator=generator)


_draw_pool: ThreadPoolExecutor | None = None
_draw_pool_size = 0


def _forget_draw_pool() -> None:
    """A forked child has none of its parent's pool threads: it makes its own pool when it first needs one."""
    global _draw_pool, _draw_pool_size
    _draw_pool, _draw_pool_size = None, 0


os.register_at_fork(after_in_child=_forget_draw_pool)


def _draws(scores: torch.Tensor, rows: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
    """The draws of `rows`, [len(rows)] long.

    torch.multinomial spends nearly all its time in `exponential_` (one exponential number per token, made one at a
    time on one core: ~2.5 ms a row at 128k tokens), so on CPU the rows are drawn side by side on up to torch's
    thread count of threads (ops release the GIL). Every row owns its generator, so the tokens are the same
    whichever thread draws them, in whatever order; rows sharing a generator (or drawing from the global one) are
    drawn one after another, in row order, as before."""
    global _draw_pool, _draw_pool_size
    workers = min(len(rows), torch.get_num_threads())
    gens = [generators[i] for i in rows]
    own = all(g is not None for g in gens) and len({id(g) for g in gens}) == len(gens)
    if workers < 2 or not own or scores.device.type != "cpu":
        return torch.cat([_draw(scores[i], generators[i]) for i in rows])
    if _draw_pool_size < workers:
        if _draw_pool is not None:
            _draw_pool.shutdown(wait=False)
        _draw_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sampling-draw")
        _draw_pool_size = workers
    return torch.cat(list(_draw_pool.map(lambda i: _draw(scores[i], generators[i]), rows)))


def _needs_float(params: list[SamplingParams], constrain: Callable | None) -> bool:
    """Whether any row's scores are changed before the choice (processors, a grammar, warpers): processors and
    warpers run on a float32 copy, a grammar alone masks the logits in place; otherwise the choice reads the
    logits as they are (bf16 too)."""
    return constrain is not None or any(p.keeps_history() or _has_warpers(p) for p in params)


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
    """Pick one token per row and report its logprob (and the alternatives asked for).

    Greedy rows take the argmax of their final scores; sampled rows a seeded multinomial draw from the softmax of
    theirs, each with its own generator (`_draws`). Every logprob, the alternatives' too, is the score minus
    the row's logsumexp from `_reduce`: no [n, vocab] log-softmax is written."""
    n = logits.shape[0]
    device = logits.device
    if n == 0:
        return Choice(torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device))
    scores, sparse = logits, {}
    if _needs_float(params, constrain):
        # greedy rows without alternatives may be chosen among their grammar's few allowed ids alone (CPU)
        plain = [i for i, p in enumerate(params) if not samples(p) and p.top_n_tokens == 0]
        scores, sparse = _final_scores(
            logits,
            params,
            histories,
            watermark_gamma,
            watermark_delta,
            constrain,
            sparse_ok=plain if constrain is not None and device.type == "cpu" else None,
        )
    token_ids, maxes, spreads = _reduce(scores, [i for i in range(n) if i not in sparse] if sparse else None)
    if sparse:
        _choose_sparse(scores, sparse, token_ids, maxes, spreads)
    drawn = [i for i, p in enumerate(params) if samples(p)]
    if drawn:
        token_ids[drawn] = _draws(scores, drawn, generators)
    # greedy rows: the chosen score is the max, so the logprob is exactly −spread
    picked = scores.gather(1, token_ids[:, None])[:, 0].float()
    choice = Choice(token_ids, (picked - maxes) - spreads)
    want = [p.top_n_tokens for p in params]
    if max(want) > 0:
        choice.top_counts, choice.top_ids, choice.top_logprobs = _top_n(scores, maxes, spreads, want)
    return choice


def sample(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [n] long, logprobs [n] float32) for rows without processors; see `choose`."""
    choice = choose(logits, params, generators)
    return choice.token_ids, choice.logprobs
