"""Seeded draws: one multinomial per sampled row, from the softmax of its final scores, with the row's own
generator (same seed → same tokens, whatever else shares the batch).

torch.multinomial spends nearly all its time in `exponential_` (one exponential number per token, made one at a
time on one core), so on CPU the rows are drawn side by side on a pool of up to torch's thread count of threads
(ops release the GIL). Every row owns its generator, so the tokens are the same whichever thread draws them, in
whatever order; rows sharing a generator (or drawing from the global one) are drawn one after another, in row
order. A forked child makes a pool of its own (it has none of its parent's threads).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _forget_pool() -> None:
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def draw(row: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A seeded draw from the softmax of one row's scores (float32, as the whole batch's float copy gave it)."""
    return torch.multinomial(torch.softmax(row.float(), dim=-1), num_samples=1, generator=generator)


def draws(scores: torch.Tensor, rows: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
    """The draws of `rows`, [len(rows)] long."""
    global _pool, _pool_size
    workers = min(len(rows), torch.get_num_threads())
    gens = [generators[i] for i in rows]
    own = all(g is not None for g in gens) and len({id(g) for g in gens}) == len(gens)
    if workers < 2 or not own or scores.device.type != "cpu":
        return torch.cat([draw(scores[i], generators[i]) for i in rows])
    if _pool_size < workers:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sampling-draw")
        _pool_size = workers
    return torch.cat(list(_pool.map(lambda i: draw(scores[i], generators[i]), rows)))
