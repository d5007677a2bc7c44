"""Seeded draws by inversion: a sampled row's token is where one uniform number, from the row's own generator,
falls in the running sum of its softmax weights (exp of the final scores less their max). Every row is drawn in a
few whole-batch ops; the generators only make one number each.

The running sum is taken in two levels, so that no second [rows, vocab] tensor is made: the sums of blocks of
BLOCK tokens, run in float64, find the block, then a running sum inside that block finds the token. The token
depends on its row's scores and generator alone, so the same seed gives the same tokens whatever else shares the
batch. A token of zero probability (its score −inf: masked, or outside top-k/top-p) is never drawn: the search
takes the first token whose running sum exceeds the number, and the sum grows only at tokens of positive
probability. Rows sharing a generator (or drawing from the global one) take their numbers from it in row order.

torch.multinomial is not used: it makes one exponential number per token of the vocabulary, serially on one core
(about 1 ms per row of a 49k vocabulary), which a batch of sampled rows pays on every step.
"""

from __future__ import annotations

import torch

BLOCK = 256  # tokens per block of the first level (a vocabulary that is no multiple of it ends in a shorter block)


def draws(scores: torch.Tensor, rows: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
    """The draws of `rows` of `scores` [n, vocab], [len(rows)] long; `generators` is per row of `scores`."""
    device = scores.device
    picked = scores if len(rows) == scores.shape[0] else scores[rows]
    weights = picked.to(torch.float32, copy=True)  # a copy: `scores` is not written
    weights.sub_(weights.amax(-1, keepdim=True)).exp_()
    n, vocab = weights.shape
    whole = vocab - vocab % BLOCK
    sums = weights[:, :whole].view(n, -1, BLOCK).sum(-1)
    if whole < vocab:  # the last, shorter block
        sums = torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], dim=1)
    ends = sums.cumsum(-1, dtype=torch.float64)  # [n, blocks]: the running sum at each block's end
    total = ends[:, -1:].contiguous()
    u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64, device=device) for i in rows])
    # below the total strictly (u·total may round up to it), so the block found has weight
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(ends, x, right=True)  # the first block whose end exceeds x
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_(min=0)), 0.0)
    ids = block * BLOCK + torch.arange(BLOCK, device=device)  # [n, BLOCK]: the block's tokens
    inside = weights.gather(1, ids.clamp(max=vocab - 1))
    inside = inside.masked_fill_(ids >= vocab, 0.0)
    at = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64) + before, x, right=True)
    # x at the block's very end by rounding (the inner sums in another order): its last token of positive weight
    last = torch.where(inside > 0, torch.arange(BLOCK, device=device), -1).amax(-1, keepdim=True)
    return (block * BLOCK + torch.minimum(at, last))[:, 0]
