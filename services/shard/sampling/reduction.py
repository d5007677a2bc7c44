"""The reductions over a batch's final scores: per row the first argmax, the max and logsumexp − max in one chunked
pass (no [rows, vocab] log-softmax is written), the same for greedy rows chosen among their grammar's few allowed
ids, and the top-n alternatives. Any row's logprob at token t is then (scores[t] − max) − spread
(`python -m bench.kernels.sampling` times it)."""

from __future__ import annotations

import numpy as np
import torch

# Rows whose scores are reduced together in `reduce`: about 4 MB of float32, so a chunk read once from memory stays
# in cache for the passes that follow.
GREEDY_CHUNK_ELEMENTS = 1 << 20


def reduce(scores: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the first argmax, the max (float32) and logsumexp − max (float32), without a [rows, vocab]
    log-softmax; any row's logprob at token t is then (scores[t] − max) − that spread.

    The log-softmax writes as much as it reads, and at a large vocabulary and batch (Gemma: 64 × 262k floats, 64 MB)
    every pass over it goes to memory: this works a few rows at a time, in cache. bf16 scores turn float32 one chunk
    at a time in a buffer (no float32 copy of them all). Per chunk: the blockwise argmax (`block_argmax`; torch's
    CPU argmax runs far slower than amax), then torch's softmax kernel, written over the buffer, whose fused
    exp-and-sum costs less than an `exp_` and a `sum` apart. Its own sum is a plain float32 running sum (~1e-5
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
        ids, top = block_argmax(src)
        token_ids[where], maxes[where] = ids, top
        probs = torch.softmax(src, dim=-1, out=part)  # in place where src is the buffer: row by row, read first
        spreads[where] = probs.sum(dim=-1).log_() - probs.gather(1, ids[:, None])[:, 0].log_()
    return token_ids, maxes, spreads


# Width of the blocks `block_argmax` reduces first.
ARGMAX_BLOCK = 128


def block_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def choose_sparse(
    scores: torch.Tensor,
    sparse: dict[int, np.ndarray],
    token_ids: torch.Tensor,
    maxes: torch.Tensor,
    spreads: torch.Tensor,
) -> None:
    """`reduce`'s results for greedy rows whose grammar allows only `sparse[row]` (ascending ids), read from those
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


def top_n(
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
