"""Tiled attention for long prefill rows: memory bounded, never a [heads, n, n] score matrix.

A long row's queries are cut into tiles of TILE_QUERIES (fewer over a very long context: TILE_SCORES). Each tile
attends only to the keys it can see: on a sliding-window layer the window before its first query up to its last
query, on a full-attention layer its causal prefix. The row's keys are gathered from the pages once per layer;
each tile's keys are a view of that gather and its [tile queries, tile keys] bool mask is built as it runs, so a
row needs beyond its own K/V one tile's mask (and, on the eager path, one tile's scores). `choose_kernel` picks a
tile's kernel: the eager math where a soft-cap is needed (Gemma-2), `half` (two half-precision GEMMs) on CPU in
bf16/fp16 without AMX, in bf16 on AMX our flash kernel (services/shard/cpu_kernels/flash_attention.cpp: the whole
row in one call, no mask) where the runner loaded the C++ kernels, else PyTorch's SDPA (float32 on CPU, the exact
mode; a full-attention row from position 0 is one `is_causal` call). docs/attention.md tells why; `python -m
bench.kernels.attention` compares the kernels and tile sizes.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from libs.runtime import cpu

# Rows with at least this many queries in a step take the tiled path; shorter rows (decodes, short chunks) keep
# the grouped path, where batching many small rows into one matmul pays more than a kernel per row.
TILE_MIN_QUERIES = 128
# Queries per tile: large enough that the kernels have blocks to spread over threads, small enough that one
# tile's mask and scores stay small next to the row's K/V (docs/attention.md).
TILE_QUERIES = 128
# Queries x keys (per head) one tile may hold on a full-attention layer: a row over a context longer than
# TILE_SCORES // TILE_QUERIES keys gets fewer queries a tile (never under TILE_FLOOR), so a chunk's eager scores
# stay flat as the context grows (over a long context the tiles' scores would set the peak memory);
# sliding-window tiles see at most window + tile keys anyway.
TILE_SCORES = 256 * 8192
TILE_FLOOR = 32

# Forces one kernel ("flash" / "sdpa" / "half" / "eager") on every tiled row: for benchmarks; None lets each layer
# choose.
KERNEL: str | None = None

# Kernel calls, by kernel ("flash": one a row; "sdpa" / "sdpa-causal" / "half" / "eager"): lets tests see that the
# tiled path ran.
STATS: Counter = Counter()


@dataclass
class TiledRow:
    """One long row of a step, cut into query tiles, for layers with one sliding window."""

    kv_blocks: torch.Tensor  # [NB] long: the blocks holding every key some query of the row sees
    q_start: int  # packed index of the row's first query
    q_pos: int  # position of the row's first query
    k_pos: int  # position of the first gathered key
    tiles: list[tuple[int, int, int, int]]  # (first query, queries, first key, keys), relative to the row / gather
    # full attention from position 0: the row is one causal square, which SDPA's flash kernel runs in one call
    # (is_causal: no mask, masked blocks skipped) exactly as transformers' sdpa attention does
    causal_square: bool = False

    @property
    def queries(self) -> int:
        """The row's queries: its tiles' together."""
        return sum(tile[1] for tile in self.tiles)


def long_rows(n_q: np.ndarray) -> np.ndarray:
    """Indices of the rows that take the tiled path."""
    return np.flatnonzero(n_q >= max(TILE_MIN_QUERIES, 2))


def build_tiled(
    paged, rows: np.ndarray, window: int, device: torch.device, tile_queries: int | None = None
) -> list[TiledRow]:
    """The tile plan of `rows` (indices into the batch) for layers with this sliding window (0: full), in tiles of
    `tile_queries` (None: TILE_QUERIES; benchmarks try others)."""
    cu, ctx, tables, bs = paged.host_cu, paged.host_context, paged.host_tables, paged.block_size
    most = tile_queries or TILE_QUERIES
    out = []
    for i in rows.tolist():
        n, c = int(cu[i + 1] - cu[i]), int(ctx[i])
        first = max(0, c - window + 1) if window else 0  # the first key the row's first query sees
        fb, lb = first // bs, -(-(c + n) // bs)
        tiles = []
        per_tile = most if window else min(most, max(TILE_FLOOR, TILE_SCORES // (c + n)))
        for t0 in range(0, n, per_tile):
            tq = min(per_tile, n - t0)
            p0 = c + t0  # position of the tile's first query
            lo = max(0, p0 - window + 1) if window else 0  # as masking_utils: kv_idx > q_idx - sliding_window
            tiles.append((t0, tq, lo - fb * bs, p0 + tq - lo))
        blocks = torch.from_numpy(np.ascontiguousarray(tables[i, fb:lb])).to(device)
        out.append(TiledRow(blocks, int(cu[i]), c, fb * bs, tiles, causal_square=not window and c == 0))
    return out


def _tile_mask(q_pos: int, queries: int, k_pos: int, keys: int, window: int, device) -> torch.Tensor | None:
    """[queries, keys] bool, True where a query may see a key; None when every query sees every key."""
    if queries == 1 and not window:
        return None
    qp = torch.arange(q_pos, q_pos + queries, device=device)[:, None]
    kp = torch.arange(k_pos, k_pos + keys, device=device)[None, :]
    visible = kp <= qp
    if window:
        visible &= kp > qp - window
    return visible


def attend_tiled(
    query: torch.Tensor,  # [heads, T, D]
    k_cache: torch.Tensor,  # [kv_heads, blocks, block_size, D]
    v_cache: torch.Tensor,
    rows: list[TiledRow],
    out: torch.Tensor,  # [T, heads, D]: each row's queries are written here
    scaling: float,
    softcap: float | None,
    window: int,
    kernel: str | None = None,  # "flash" / "sdpa" / "half" / "eager"; None: choose_kernel (benchmarks force one)
    kernels: bool = False,  # the runner loaded the C++ kernels (services/shard/cpu_kernels/)
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,  # the step's new K/V, [T, kv_heads, D] each
) -> None:
    kernel = kernel or KERNEL or choose_kernel(query, softcap, kernels and k_cache.dtype == query.dtype)
    if kernel in ("flash", "sdpa", "half") and softcap is not None:
        raise ValueError(f"the {kernel} kernel cannot soft-cap attention scores")
    heads, _, head_dim = query.shape
    kv_heads = k_cache.shape[0]
    for row in rows:
        n = row.queries
        if kernel == "flash" and row.q_pos == 0 and fresh is not None:  # no context: the step's own K/V, no gather
            k, v = (t[row.q_start : row.q_start + n].transpose(0, 1) for t in fresh)
        else:  # the row's keys once per layer: [kv_heads, NB, bs, D] is [kv_heads, keys, D] as it stands
            k = k_cache.index_select(1, row.kv_blocks).view(kv_heads, -1, head_dim)
            v = v_cache.index_select(1, row.kv_blocks).view(kv_heads, -1, head_dim)
        if kernel == "flash":  # the whole row in one call: the kernel reads only the key blocks each query sees
            q, o = query[:, row.q_start : row.q_start + n], out[row.q_start : row.q_start + n]
            torch.ops.switchyard_cpu.flash_attention(q, k, v, o, row.q_pos, row.k_pos, window, scaling)
            STATS["flash"] += 1
            continue
        if kernel == "sdpa" and row.causal_square:
            o = F.scaled_dot_product_attention(
                query[None, :, row.q_start : row.q_start + n],
                k[None, :, :n],
                v[None, :, :n],
                is_causal=True,
                scale=scaling,
                enable_gqa=heads != kv_heads,
            )
            out[row.q_start : row.q_start + n] = o[0].transpose(0, 1)
            STATS["sdpa-causal"] += 1
            continue
        for t0, tq, k0, nk in row.tiles:
            q = query[:, row.q_start + t0 : row.q_start + t0 + tq]  # [heads, tq, D]
            mask = (
                None if kernel == "half" else _tile_mask(row.q_pos + t0, tq, row.k_pos + k0, nk, window, query.device)
            )
            kt, vt = k[:, k0 : k0 + nk], v[:, k0 : k0 + nk]
            if kernel == "sdpa":
                o = _sdpa_tile(q, kt, vt, mask, scaling)
            elif kernel == "half":
                o = half_tile(q, kt, vt, row.q_pos + t0, row.k_pos + k0, window, scaling)
            else:
                o = eager_tile(q, kt, vt, mask, scaling, softcap)
            STATS[kernel] += 1
            out[row.q_start + t0 : row.q_start + t0 + tq] = o.transpose(0, 1)


def choose_kernel(query: torch.Tensor, softcap: float | None, kernels: bool = False) -> str:
    """The kernel for tiles of this layer: eager where a soft-cap is needed, half-precision GEMMs on CPU in half
    precision (faster there than SDPA's flash kernel), else SDPA. In bf16 on a CPU with AMX, our flash kernel
    (cpu_kernels/flash_attention.cpp) where the C++ kernels are loaded (`kernels`), else SDPA: both run their bf16
    blocks on the AMX tiles, faster than the two GEMMs with a softmax pass between them; ours reads only the key
    blocks a query sees, so a sliding-window layer costs its window."""
    if softcap is not None:
        return "eager"
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        if query.dtype != torch.bfloat16 or "amx_bf16" not in cpu.flags():
            return "half"
        return "flash" if kernels and query.shape[-1] % 32 == 0 and flash_ready() else "sdpa"
    return "sdpa"


@functools.cache
def flash_ready() -> bool:
    """Whether the flash kernel runs here (the C++ kernels loaded, oneDNN's brgemm in bf16: a CPU with AMX)."""
    return torch.ops.switchyard_cpu.flash_attention_ready()


def _sdpa_tile(q, k, v, mask, scaling) -> torch.Tensor:
    """[heads, tq, D] by PyTorch's SDPA (the CPU flash kernel: GQA and a boolean mask without leaving it)."""
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scaling, enable_gqa=q.shape[0] != k.shape[0]
    )
    return o[0]


def half_tile(q, k, v, q_pos: int, k_pos: int, window: int, scaling: float) -> torch.Tensor:
    """[heads, tq, D] with q·kᵀ straight into half-precision scores; the query heads sharing a KV head are folded
    into the queries. Only the key columns some query cannot see are masked: those past the first query (causal)
    and, on a sliding layer, those the last query's window has left behind."""
    heads, tq, head_dim = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    if math.frexp(scaling)[0] == 0.5:  # a power of two (1/8, 1/16): scaling q first rounds nothing, and is tq x D
        # written straight into a contiguous [heads, tq, D] (q is a strided view of the token-major queries: `q *
        # scaling` would keep its strides and the reshape copy it again)
        scaled = torch.empty(heads, tq, head_dim, dtype=q.dtype, device=q.device)
        scores = torch.bmm(torch.mul(q, scaling, out=scaled).view(kv_heads, -1, head_dim), k.transpose(1, 2))
    else:  # after the product, in place, where transformers' eager attention rounds it (q first: other roundings)
        scores = torch.bmm(q.reshape(kv_heads, -1, head_dim), k.transpose(1, 2)).mul_(scaling)
    grid = scores.view(kv_heads, heads // kv_heads, tq, keys)
    right = max(0, q_pos + 1 - k_pos)  # first column with a key later than the first query
    left = max(0, q_pos + tq - window - k_pos) if window else 0  # columns before the last query's window
    edges = [(0, keys)] if left > right else [(0, left), (right, keys)]
    for c0, c1 in edges:
        if c1 > c0:
            visible = _tile_mask(q_pos, tq, k_pos + c0, c1 - c0, window, q.device)
            if visible is not None:
                grid[..., c0:c1].masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # float32 inside, half in and out
    return torch.bmm(probs, v).view(heads, tq, head_dim)


def eager_tile(q, k, v, mask, scaling, softcap) -> torch.Tensor:
    """[heads, tq, D] by transformers' eager math; the query heads sharing a KV head are folded into the queries."""
    heads, tq, head_dim = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    n_rep = heads // kv_heads
    scores = torch.matmul(q.reshape(kv_heads, n_rep * tq, head_dim), k.transpose(1, 2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(kv_heads, n_rep, tq, keys)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(kv_heads, n_rep * tq, keys), v).view(heads, tq, head_dim)
