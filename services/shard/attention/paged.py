"""Paged attention, plugged into transformers through its `AttentionInterface`.

The model runs on a packed batch (every row's new tokens in one [1, T] sequence, no padding); transformers calls
`paged_attention` once per layer with all of it, and `attention_mask` is always None (masking_utils builds no mask
for an implementation it does not know). The new K/V go into the head-major cache [kv_heads, blocks, block_size,
D] by one `index_copy_` (backend "cpu": cpu_kernels' `write_kv`); each row attends over its own context, gathered
from its blocks, by transformers' eager math, so float32 output matches `generate()` token for token. Rows are
bucketed into groups of similar (query, key) lengths, one batched matmul each (padding masked; one-query rows
apart), whose gather indices and masks are built once per step and window and shared by every layer; GQA folds the
heads sharing a KV head into the query dimension. Long prefill rows run tiled (services/shard/attention/tiled.py).
docs/attention.md tells why. This is the reference path; a PagedBatch whose `backend` is "triton" hands each layer
to services/shard/attention/triton.py, and "cpu" its short rows to the C++ kernel of services/shard/attention/cpu.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface

from services.shard.attention import bidirectional, cpu
from services.shard.attention.tiled import TiledRow, attend_tiled, build_tiled, long_rows

ATTN_IMPLEMENTATION = "switchyard_paged"

# A group's padded work (rows x queries x keys) may exceed its real work by this factor before a row starts a new
# group: bounds the waste of padding while keeping the number of groups (batched matmuls per layer) small.
PAD_SLACK = 2.0

# K/V writes by way ("kernel": cpu_kernels' write_kv; "index_copy"): lets tests see which one ran
WRITES: Counter = Counter()


@dataclass
class _Group:
    """Rows attended in one batched matmul: where their queries are, which slots they read, what they see."""

    q_index: torch.Tensor  # [R * Q] long: packed token index of each query, row by row (padding: 0)
    kv_blocks: torch.Tensor  # [R * NB] long: the blocks holding each row's keys, row by row (padding: block 0, masked)
    hidden: torch.Tensor  # [1, R, 1, Q, NB * block_size] bool: True where a query must not see a key
    out_rows: torch.Tensor  # [N] long: packed token index of each real query, in (row, query) order
    q_valid: torch.Tensor | None  # [R, Q] bool, None when every row has Q queries
    rows: int = 0  # R
    queries: int = 0  # Q: queries of the longest row
    whole: bool = False  # the group is every row, one query each, in packed order: its output is the output
    hidden_rows: torch.Tensor | None = None  # one-query groups: `hidden` as [kv_heads * R, 1, keys] (`_attend_one`)


@dataclass
class PagedBatch:
    """What the attention function needs about the packed batch; passed to the model as the `paged` kwarg.

    Built once per step by the model runner and shared by every layer.
    """

    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv_heads, blocks, block_size, D]
    slot_mapping: torch.Tensor  # [T] long: the cache slot (block * block_size + offset) of each new token
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32: row i's queries are tokens cu[i]:cu[i+1]
    context_lens: torch.Tensor  # [rows] int32: tokens in the cache before this step
    block_tables: torch.Tensor  # [rows, max_blocks] int32, padded with -1 (for varlen kernels)
    # Host-side copies, to build the gather plans without a device sync:
    block_size: int = 16
    host_cu: np.ndarray = None  # [rows + 1] int64
    host_context: np.ndarray = None  # [rows] int64
    host_tables: np.ndarray = None  # [rows, max_blocks] int64, padded with -1
    # per layer (K, V) as [kv_heads, slots, D] views (None: formed per call); the runner forms them once at load
    kv_flat: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # "torch": the ops below (the reference); "triton": services/shard/attention/triton.py; "cpu": short rows
    # (decodes, verified drafts) by services/shard/attention/cpu.py, the K/V write by cpu_kernels' write_kv, the rest
    # by the ops below
    backend: str = "torch"
    # row -> [n, 2] positions [start, end) seen both ways in prefill (bidirectional.py); empty: causal everywhere
    spans: dict = field(default_factory=dict)
    # backend "cpu": the short rows the C++ kernel attends (services/shard/attention/cpu.py), else None
    short: cpu.ShortRows | None = None
    _groups: dict = field(default_factory=dict)  # sliding window (0 = none) -> (groups, tiled rows)

    @classmethod
    def from_host(
        cls,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: np.ndarray,
        cu: np.ndarray,
        context_lens: np.ndarray,
        tables: np.ndarray,
        block_size: int,
        device: torch.device,
        **extra,
    ) -> PagedBatch:
        """The batch from its host arrays (int64: slots [T], cu [rows + 1], context lengths [rows], block tables
        [rows, max_blocks] padded with -1), copied to `device`; `extra`: kv_flat, backend, spans."""
        short = cpu.ShortRows.of(cu, context_lens) if extra.get("backend") == "cpu" else None
        return cls(
            kv_cache=kv_cache,
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(device),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
            block_size=block_size,
            host_cu=cu,
            host_context=context_lens,
            host_tables=tables,
            short=short,
            **extra,
        )

    def plan(self, window: int, device: torch.device) -> tuple[list[_Group], list[TiledRow]]:
        """For layers with this sliding window (0: full attention), built on first use: the groups of short rows
        and the tile plans of long prefill rows."""
        got = self._groups.get(window)
        if got is None:
            n_q = self.host_cu[1:] - self.host_cu[:-1]
            tiled = long_rows(n_q)
            if self.spans:  # rows with bidirectional spans take the grouped path, whose mask carries them
                bidirectional.check(self.spans, self.host_context, n_q)
                tiled = np.setdiff1d(tiled, np.fromiter(self.spans, dtype=np.int64))
            short = np.setdiff1d(np.arange(len(n_q)), tiled) if len(tiled) else np.arange(len(n_q))
            if self.backend == "cpu" and self.short is not None:  # the kernel's rows are not the groups'
                short = np.setdiff1d(short, self.short.rows)
            groups = _build_groups(self, short, window, device) if len(short) else []
            got = self._groups[window] = (groups, build_tiled(self, tiled, window, device))
        return got


def _bucket(q_lens: np.ndarray, k_lens: np.ndarray) -> list[np.ndarray]:
    """Row indices grouped so that each group's padded work stays within PAD_SLACK of its real work."""
    order = np.lexsort((q_lens, k_lens))[::-1]  # longest first: a group's first row sets its key length
    groups, current, real, q_max = [], [], 0, 0
    for i in order.tolist():
        q, k = int(q_lens[i]), int(k_lens[i])
        if current:
            padded = (len(current) + 1) * max(q_max, q) * int(k_lens[current[0]])
            if padded > PAD_SLACK * (real + q * k):
                groups.append(np.sort(current))  # packed order within a group
                current, real, q_max = [], 0, 0
        current.append(i)
        real += q * k
        q_max = max(q_max, q)
    if current:
        groups.append(np.sort(current))
    return groups


def _build_groups(paged: PagedBatch, subset: np.ndarray, window: int, device: torch.device) -> list[_Group]:
    cu, ctx, tables, bs = paged.host_cu, paged.host_context, paged.host_tables, paged.block_size
    n_q = cu[1:] - cu[:-1]
    # A sliding-window layer never looks further back than the window: gather only what the first query can see.
    first = np.maximum(0, ctx - window + 1) if window else np.zeros_like(ctx)
    out = []
    first_block = first // bs
    n_b = -(-(ctx + n_q) // bs) - first_block  # blocks a row reads
    # one-query rows (decodes) never share a group with longer ones (verified drafts, prefill chunks): they keep the
    # one-query product (`_attend_one`) whatever else the step holds
    parts = [p for p in (subset[n_q[subset] == 1], subset[n_q[subset] > 1]) if len(p)]
    for part, rows in ((p, r) for p in parts for r in _bucket(n_q[p], n_b[p] * bs)):
        rows = part[rows]
        nq, c, fb = n_q[rows], ctx[rows], first_block[rows]
        Q, NB = int(nq.max()), int(n_b[rows].max())
        jb = np.arange(NB)
        b_valid = jb[None, :] < n_b[rows][:, None]
        blocks = np.where(b_valid, np.take_along_axis(tables[rows], np.where(b_valid, fb[:, None] + jb, 0), 1), 0)
        # position of every gathered key; padding blocks lie past the row's last query: hidden by causality
        k_pos = fb[:, None] * bs + np.arange(NB * bs)[None, :]  # [R, L]
        qi = np.arange(Q)
        q_valid = qi[None, :] < nq[:, None]  # [R, Q]
        q_pos = c[:, None] + qi[None, :]
        visible = k_pos[:, None, :] <= q_pos[:, :, None]
        if paged.spans:  # OR(causal, same span), then the window over both, as gemma3's masks compose
            bidirectional.widen(visible, paged.spans, rows, q_pos, k_pos)
        if window:  # as masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window
            visible &= k_pos[:, None, :] > q_pos[:, :, None] - window
        visible[~q_valid] = False
        visible[~q_valid, 0] = True  # padding queries see one key: no all -inf softmax row (NaN)
        q_index = np.where(q_valid, cu[rows][:, None] + qi[None, :], 0)
        all_valid = bool(q_valid.all())
        out.append(
            _Group(
                q_index=torch.from_numpy(q_index.reshape(-1)).to(device),
                kv_blocks=torch.from_numpy(blocks.reshape(-1)).to(device),
                hidden=torch.from_numpy(~visible).to(device)[None, :, None],
                out_rows=torch.from_numpy(q_index[q_valid]).to(device),
                q_valid=None if all_valid else torch.from_numpy(q_valid).to(device),
                rows=len(rows),
                queries=Q,
                whole=Q == 1 and len(rows) == len(n_q),
            )
        )
    return out


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,  # eval only: ignored
    softcap: float | None = None,
    sliding_window: int | None = None,
    paged: PagedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the `paged` model kwarg (see ModelRunner)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # [1, heads, T, D] as token-major views [T, heads, D]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = attend_layer(module.layer_idx, q, k, v, paged, scaling, softcap, int(sliding_window or 0))
    return out.unsqueeze(0), None  # [1, T, heads, D], like eager's transposed output


def attend_layer(
    layer: int,
    query: torch.Tensor,  # [T, heads, D]
    key: torch.Tensor,  # [T, kv_heads, D]
    value: torch.Tensor,  # [T, kv_heads, D]
    paged: PagedBatch,
    scaling: float,
    softcap: float | None,
    window: int,  # 0: full attention
) -> torch.Tensor:
    """One layer's attention over the packed batch, [T, heads, D]: the new K/V into the pages, then every row
    over its context (the decoder walk calls this directly; transformers' models through `paged_attention`)."""
    if paged.backend == "triton":
        if paged.spans:
            raise ValueError("bidirectional spans are served by the torch paged attention only")
        from services.shard.attention.triton import attend_layer_triton  # imports triton: only for this backend

        return attend_layer_triton(layer, query, key, value, paged, scaling, softcap, window)
    k_cache, v_cache = paged.kv_cache[layer]
    short = paged.short if paged.backend == "cpu" else None
    if short is not None and short.every_row:  # the kernel writes the step's K/V and attends every token
        return cpu.attend(short, layer, query, key, value, paged, scaling, softcap, window, True, None)
    write_kv(layer, key, value, paged)
    groups, tiled = paged.plan(window, query.device)
    out = None
    if groups:
        out = attend(query, k_cache, v_cache, groups, scaling, softcap)
    if tiled:
        if out is None:
            out = query.new_empty(query.shape)
        attend_tiled(query.transpose(0, 1), k_cache, v_cache, tiled, out, scaling, softcap, window,
                     kernels=paged.backend == "cpu", fresh=(key, value))  # fmt: skip
    if short is not None and len(short.rows):
        out = cpu.attend(short, layer, query, key, value, paged, scaling, softcap, window, False, out)
    return out


def write_kv(layer: int, key: torch.Tensor, value: torch.Tensor, paged: PagedBatch) -> None:
    """The step's new K/V ([T, kv_heads, D] each) into layer `layer`'s pages, at `paged.slot_mapping`."""
    k_cache, v_cache = paged.kv_cache[layer]
    if paged.kv_flat is not None:
        k_flat, v_flat = paged.kv_flat[layer]
    else:
        k_flat, v_flat = (c.view(c.shape[0], -1, c.shape[3]) for c in (k_cache, v_cache))
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    if paged.backend == "cpu":  # the C++ kernels are loaded: one copy per token and head (cpu_kernels/kv_write.cpp)
        torch.ops.switchyard_cpu.write_kv(k_flat, v_flat, paged.slot_mapping, key, value)
        WRITES["kernel"] += 1
        return
    # [kv_heads, T, D] into the flat slots
    k_flat.index_copy_(1, paged.slot_mapping, key.transpose(0, 1))
    v_flat.index_copy_(1, paged.slot_mapping, value.transpose(0, 1))
    WRITES["index_copy"] += 1


def attention_backend(choice: str, device: torch.device, cpu_kernels: bool = False) -> str:
    """The attention backend for ModelRunner's `attention` setting: "torch", "triton" or "cpu" as given; "auto" is
    triton on CUDA where triton imports, "cpu" on CPU where the runner loaded the C++ kernels (`cpu_kernels`: half
    precision only), else torch."""
    if choice not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"attention must be auto, torch, triton or cpu, not {choice!r}")
    if choice == "cpu" and not cpu_kernels:
        raise ValueError("attention cpu needs the CPU kernels (a CPU device, half precision, a C++ compiler)")
    if choice == "auto" and cpu_kernels:
        return "cpu"
    if choice != "auto" or torch.device(device).type != "cuda":
        return "torch" if choice == "auto" else choice
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def attend(
    tokens: torch.Tensor,  # [T, heads, D]
    k_cache: torch.Tensor,  # [kv_heads, blocks, block_size, D]
    v_cache: torch.Tensor,
    groups: list[_Group],
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    total, heads, head_dim = tokens.shape
    kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    n_rep = heads // kv_heads
    if groups[0].whole:  # every row decodes: one batched product, its output is the output
        return _attend_one(tokens, k_cache, v_cache, groups[0], scaling, softcap)
    # transformers' repeat_kv order: kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1
    by_kv_head = tokens.transpose(0, 1).view(kv_heads, n_rep, total, head_dim)
    out = tokens.new_empty(total, heads, head_dim)
    for g in groups:
        rows, q_len = g.rows, g.queries
        if q_len == 1:
            out[g.out_rows] = _attend_one(tokens.index_select(0, g.q_index), k_cache, v_cache, g, scaling, softcap)
            continue
        keys = g.kv_blocks.shape[0] // rows * block_size
        q = by_kv_head.index_select(2, g.q_index)
        # [kv_heads, n_rep, R * Q, D] -> [kv_heads, R, n_rep * Q, D]: the heads sharing a KV head are extra queries
        q = q.view(kv_heads, n_rep, rows, q_len, head_dim).transpose(1, 2).reshape(kv_heads, rows, -1, head_dim)
        # whole pages, one copy: [kv_heads, R * NB, bs, D] is [kv_heads, R, keys, D] as it stands
        k = k_cache.index_select(1, g.kv_blocks).view(kv_heads, rows, keys, head_dim)
        v = v_cache.index_select(1, g.kv_blocks).view(kv_heads, rows, keys, head_dim)
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # [kv_heads, R, n_rep * Q, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(kv_heads, rows, n_rep, q_len, keys).masked_fill(g.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs.view(kv_heads, rows, n_rep * q_len, keys), v)  # [kv_heads, R, n_rep * Q, D]
        o = o.view(kv_heads, rows, n_rep, q_len, head_dim).permute(1, 3, 0, 2, 4)  # [R, Q, kv_heads, n_rep, D]
        o = o.reshape(rows, q_len, heads, head_dim)
        out[g.out_rows] = o[g.q_valid] if g.q_valid is not None else o.reshape(-1, heads, head_dim)
    return out


def _attend_one(
    q: torch.Tensor,  # [R, heads, D]: one query per row
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: _Group,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """[R, heads, D] for a group of one-query rows (decodes): the same products as the general path (its matmul
    runs as this bmm over [kv_heads * R] matrices), with as few ops as the math allows and the elementwise steps
    in place."""
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    n_rep = heads // kv_heads
    keys = g.kv_blocks.shape[0] // rows * k_cache.shape[2]
    # [R, heads, D] -> [kv_heads * R, n_rep, D]: the query heads of KV head j (repeat_kv's order) per row
    if rows == 1:
        q = q.view(kv_heads, n_rep, head_dim)
    else:
        q = q.view(rows, kv_heads, n_rep, head_dim).transpose(0, 1).reshape(kv_heads * rows, n_rep, head_dim)
    k = k_cache.index_select(1, g.kv_blocks).view(kv_heads * rows, keys, head_dim)
    v = v_cache.index_select(1, g.kv_blocks).view(kv_heads * rows, keys, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scaling)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if g.hidden_rows is None:  # [1, R, 1, 1, keys] -> per (KV head, row) matrix, formed once per step and window
        g.hidden_rows = g.hidden.view(1, rows, 1, keys).expand(kv_heads, -1, -1, -1).reshape(-1, 1, keys)
    scores.masked_fill_(g.hidden_rows, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if probs.dtype != q.dtype:
        probs = probs.to(q.dtype)
    o = torch.bmm(probs, v)  # [kv_heads * R, n_rep, D]
    if rows == 1:
        return o.view(1, heads, head_dim)
    return o.view(kv_heads, rows, n_rep, head_dim).transpose(0, 1).reshape(rows, heads, head_dim)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
