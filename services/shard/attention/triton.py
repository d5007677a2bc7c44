"""Paged attention as one Triton kernel over the packed batch: prefill chunks and decode rows in one launch.

`attend_layer_triton` has `attend_layer`'s signature and meaning (services/shard/attention/paged.py): the step's new
K/V go into the head-major pages [kv_heads, blocks, block_size, D] first (the same `write_kv`), then every row
attends over its context, read in place through its block table. A program owns one tile of a row's queries times
the query heads that share one KV head (GQA heads packed into the tile's M dimension, repeat_kv's order); programs
find their row by a binary search over cu_seqlens_q, so the grid depends only on the batch's shape, never on its
host copies. Query i of a row sits at position context_len + i and sees keys at positions <= its own and, on a
sliding-window layer, > position - window (masking_utils' convention, as the torch path); a soft-cap applies
tanh(s / cap) * cap before the mask. Softmax is online, in float32; float32 inputs use IEEE dots, so the output
matches the torch path to rounding. Few one-tile rows over long contexts split their keys into segments (split-KV,
a third grid axis), whose partial softmaxes a second kernel combines (`split_segments` decides, from host copies
only). This module imports triton: paged.py loads it only for the triton backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.shard.attention.paged import PagedBatch, write_kv

# Keys per inner tile (a tile may span several pages: each key finds its page through the block table).
BLOCK_N = 32
# Split-KV (few rows over long contexts): a launch of fewer programs than SPLIT_PROGRAMS (a GPU's SMs, twice over)
# splits each row's keys into up to MAX_SEGMENTS segments of at least SPLIT_MIN_KEYS keys; a second kernel combines.
SPLIT_PROGRAMS = 256
SPLIT_MIN_KEYS = 512
MAX_SEGMENTS = 16


@triton.jit
def _tanh(x):
    """tanh without libdevice (the interpreter has none): a Taylor series near 0, where exp's form cancels."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    near = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.0625, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _find_row(cu_ptr, program, num_rows, BLOCK_Q: tl.constexpr):
    """The row whose query tiles include `program`: row r's tiles start at cu[r] // BLOCK_Q + r."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if start <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, heads, D]
    k_ptr,  # [kv_heads, blocks, block_size, D]
    v_ptr,
    out_ptr,  # [T, heads, D]
    part_m_ptr,  # SEGMENTS > 1: [T, heads, SEGMENTS] float32, each segment's running maximum (unused otherwise)
    part_l_ptr,  # ... its sum of exponentials
    part_acc_ptr,  # ... [T, heads, SEGMENTS, HEAD_DIM] float32, its unnormalized output
    cu_ptr,  # [rows + 1] int32
    ctx_ptr,  # [rows] int32
    tables_ptr,  # [rows, max_blocks] int32
    num_rows,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_table,
    N_REP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q queries x N_REP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # block_size
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    SEGMENTS: tl.constexpr,  # 1: the output itself; > 1: this program's share of the keys, into the partials
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = _find_row(cu_ptr, program, num_rows, BLOCK_Q)
    q_begin = tl.load(cu_ptr + row)
    q_len = tl.load(cu_ptr + row + 1) - q_begin
    tile = program - (q_begin // BLOCK_Q + row)
    if tile * BLOCK_Q < q_len:
        context = tl.load(ctx_ptr + row)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        q_local = tile * BLOCK_Q + offs_m // N_REP  # the query's index within its row
        head = kv_head * N_REP + offs_m % N_REP
        m_valid = (offs_m < BLOCK_Q * N_REP) & (q_local < q_len)
        d_valid = offs_d < HEAD_DIM
        q_pos = context + q_local  # the query's position
        token = (q_begin + q_local).to(tl.int64)
        q_off = token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=m_valid[:, None] & d_valid[None, :], other=0.0).to(k_ptr.dtype.element_ty)

        # the keys some query of the tile sees: [first, last]
        q_last = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        k_end = context + q_last + 1
        k_start = 0
        if WINDOW:
            k_start = tl.maximum(0, context + tile * BLOCK_Q - window + 1)
        if SEGMENTS > 1:  # split-KV: segment s of SEGMENTS takes its run of whole key tiles
            seg_len = tl.cdiv(tl.cdiv(k_end - k_start, SEGMENTS), BLOCK_N) * BLOCK_N
            k_start = k_start + tl.program_id(2) * seg_len
            k_end = tl.minimum(k_start + seg_len, k_end)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        table = tables_ptr + row.to(tl.int64) * stride_table
        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        for n0 in range(k_start, k_end, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            n_valid = k_pos < k_end
            page = tl.load(table + k_pos // PAGE, mask=n_valid, other=-1).to(tl.int64)
            n_valid = n_valid & (page >= 0)  # a table's -1 padding is never read (a graph's padding rows)
            in_page = (k_pos % PAGE).to(tl.int64)
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(
                k_base + (page * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_base + (page * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] float32
            if SOFTCAP:
                s = _tanh(s / softcap) * softcap
            visible = (k_pos[None, :] <= q_pos[:, None]) & n_valid[None, :] & m_valid[:, None]
            if WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # stays -inf while a query has seen no key
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # what exp subtracts: never -inf - -inf (NaN)
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        if SEGMENTS == 1:
            l_i = tl.where(l_i > 0, l_i, 1.0)
            out = acc / l_i[:, None]
            o_off = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
        else:
            part = (token * (N_REP * tl.num_programs(1)) + head) * SEGMENTS + tl.program_id(2)
            tl.store(part_m_ptr + part, m_i, mask=m_valid)
            tl.store(part_l_ptr + part, l_i, mask=m_valid)
            a_off = part[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(part_acc_ptr + a_off, acc, mask=m_valid[:, None] & d_valid[None, :])


@triton.jit
def _combine_segments_kernel(
    out_ptr,  # [T, heads, D]
    part_m_ptr,  # [T, heads, SEGMENTS]
    part_l_ptr,
    part_acc_ptr,  # [T, heads, SEGMENTS, HEAD_DIM]
    heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SEGMENTS: tl.constexpr,
):
    """One (token, head): the segments' partial softmaxes rescaled to their common maximum and summed."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * heads + head) * SEGMENTS + tl.arange(0, SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_m_ptr + part)  # -inf: a segment with no key this query sees
    l_s = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max > float("-inf"), m_max, 0.0))
    total = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    o_off = token * stride_ot + head.to(tl.int64) * stride_oh + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def attend_layer_triton(
    layer: int,
    query: torch.Tensor,  # [T, heads, D]
    key: torch.Tensor,  # [T, kv_heads, D]
    value: torch.Tensor,  # [T, kv_heads, D]
    paged: PagedBatch,
    scaling: float,
    softcap: float | None,
    window: int,  # 0: full attention
    out: torch.Tensor | None = None,  # [T, heads, D], contiguous in D; None: allocated
    segments: int | None = None,  # split-KV segments, a power of two (None: `split_segments` chooses)
) -> torch.Tensor:
    """`attend_layer` by the Triton kernel: the new K/V into the pages, then one launch for every row (with
    split-KV, a second one that combines the segments)."""
    write_kv(layer, key, value, paged)
    k_cache, v_cache = paged.kv_cache[layer]
    total, heads, head_dim = query.shape
    kv_heads = k_cache.shape[0]
    n_rep = heads // kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if total == 0:
        return out
    rows = paged.cu_seqlens_q.shape[0] - 1
    longest = int((paged.host_cu[1:] - paged.host_cu[:-1]).max()) if paged.host_cu is not None else total
    head_pad = triton.next_power_of_2(head_dim)
    # decodes: the smallest tile that fills a dot; prefill: taller tiles (fewer over wide heads)
    block_m = 16 if longest * n_rep <= 16 else (64 if head_pad <= 128 else 32)
    block_m = max(block_m, triton.next_power_of_2(n_rep))
    block_q = block_m // n_rep
    if segments is None:
        segments = split_segments(paged, rows * kv_heads if longest <= block_q else None)
    grid = (total // block_q + rows, kv_heads, segments)
    fp32 = query.dtype == torch.float32
    part_m = part_l = part_acc = out  # placeholders: read only with SEGMENTS > 1
    if segments > 1:
        part_m, part_l = (torch.empty(total, heads, segments, dtype=torch.float32, device=query.device) for _ in "ml")
        part_acc = torch.empty(total, heads, segments, head_dim, dtype=torch.float32, device=query.device)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        part_m,
        part_l,
        part_acc,
        paged.cu_seqlens_q,
        paged.context_lens,
        paged.block_tables,
        rows,
        float(scaling),
        float(softcap or 0.0),
        int(window),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        paged.block_tables.stride(0),
        N_REP=n_rep,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        PAGE=paged.block_size,
        SOFTCAP=bool(softcap),
        WINDOW=bool(window),
        PRECISION="ieee" if fp32 else "tf32",
        SEGMENTS=segments,
    )
    if segments > 1:
        _combine_segments_kernel[(total, heads)](
            out,
            part_m,
            part_l,
            part_acc,
            heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            SEGMENTS=segments,
        )
    return out


def split_segments(paged: PagedBatch, programs: int | None) -> int:
    """Split-KV segments for a launch of `programs` (None: rows of more than one query tile, never split): more
    while the launch is smaller than SPLIT_PROGRAMS and every segment keeps SPLIT_MIN_KEYS keys of the longest
    row. Needs the host copy of the context lengths (a captured graph has none: one segment)."""
    if programs is None or paged.host_context is None or paged.host_cu is None:
        return 1
    longest = int((paged.host_context + paged.host_cu[1:] - paged.host_cu[:-1]).max())
    segments = 1
    while segments < MAX_SEGMENTS and programs * segments < SPLIT_PROGRAMS and longest >= 2 * segments * SPLIT_MIN_KEYS:
        segments *= 2
    return segments
