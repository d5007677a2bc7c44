"""The CPU backend: short rows (decodes, verified drafts: at most SHORT_QUERIES new tokens) attend through the C++
kernel (services/shard/cpu_kernels/attention.cpp), which reads each row's keys in place from its pages; longer rows
(prefill chunks) and bidirectional spans take the torch ops of paged.py. The kernel computes each token alone, so a
token's attention is the same whatever else its row or the step holds (a verified draft gets its decode's values).

Half precision only: the runner picks this backend where it loaded the kernels for a bf16/fp16 model, and float32
(the exact mode) keeps the torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# rows with at most this many new tokens go to the kernel (a decode: 1; speculation's verified drafts: k + 1); a
# prefill chunk is longer and its batched products win
SHORT_QUERIES = 16

# layers attended by the kernel in this process (tests read it to show the kernel ran)
layers_attended = 0


@dataclass
class ShortRows:
    """The step's rows for the kernel, built once per step from the host arrays and shared by every layer."""

    rows: np.ndarray  # the short rows' indices
    tokens: torch.Tensor  # [N] int32: their tokens (packed indices)
    token_rows: torch.Tensor  # [T] int32: every token's row
    positions: torch.Tensor  # [T] int32: every token's position
    every_row: bool  # the kernel attends every token of the step (and writes the step's K/V itself)

    @classmethod
    def of(cls, cu: np.ndarray, context_lens: np.ndarray) -> ShortRows | None:
        """From the row bounds `cu` [rows + 1] and the tokens cached before the step [rows]; None without a short
        row."""
        n_q = cu[1:] - cu[:-1]
        short = (n_q >= 1) & (n_q <= SHORT_QUERIES)
        if not short.any():
            return None
        token_rows = np.repeat(np.arange(len(n_q)), n_q)
        positions = context_lens[token_rows] + np.arange(int(cu[-1])) - cu[token_rows]
        return cls(
            rows=np.flatnonzero(short),
            tokens=torch.from_numpy(np.flatnonzero(short[token_rows]).astype(np.int32)),
            token_rows=torch.from_numpy(token_rows.astype(np.int32)),
            positions=torch.from_numpy(positions.astype(np.int32)),
            every_row=bool(short.all()),
        )


def attend(
    short: ShortRows,
    layer: int,
    query: torch.Tensor,  # [T, heads, D]
    key: torch.Tensor,  # [T, kv_heads, D]
    value: torch.Tensor,
    paged,  # PagedBatch
    scaling: float,
    softcap: float | None,
    window: int,
    write: bool,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`out` ([T, heads, D], contiguous; None: a new one) with the short rows' tokens attended; `write`: their K/V
    go into the pages first (else the caller wrote the step's)."""
    global layers_attended
    k_cache, v_cache = paged.kv_cache[layer]
    if not query.dtype == key.dtype == k_cache.dtype:
        raise ValueError(f"the CPU kernel needs q, k and the pages in one dtype ({query.dtype}, {k_cache.dtype})")
    if out is None:
        out = query.new_empty(query.shape)
    layers_attended += 1
    torch.ops.switchyard_cpu.attend_short_rows(
        query, key, value, k_cache, v_cache, paged.slot_mapping, paged.block_tables, short.token_rows,
        short.positions, short.tokens, write, out, scaling, softcap or 0.0, window,
    )  # fmt: skip
    return out
