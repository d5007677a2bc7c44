"""Paged attention, plugged into transformers through its `AttentionInterface`.

The model runs on a packed batch: every row's new tokens concatenated into one [1, T] sequence, no padding.
transformers computes q/k/v (and RoPE from our position ids) and then calls `paged_attention` once per layer
with the whole packed batch. We write the new K/V into the paged cache and let each row attend over its own
context, gathered from its blocks. transformers builds no mask for an implementation it does not know
(masking_utils skips names missing from `AttentionMaskInterface`), so `attention_mask` is always None here.

The math mirrors transformers' eager attention (matmul, scale, soft-cap, mask, float32 softmax, matmul) so
float32 output matches `generate()` token for token. One Python loop per row for now; a varlen kernel
(flash-attn on CUDA) can replace `_attend_rows` without touching the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "switchyard_paged"


@dataclass
class PagedBatch:
    """What the attention function needs about the packed batch; passed to the model as the `paged` kwarg.

    Built once per step by the model runner and shared by every layer.
    """

    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [num_slots, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] long: the cache slot of each new token
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32: row i's queries are tokens cu[i]:cu[i+1]
    context_lens: torch.Tensor  # [rows] int32: tokens in the cache before this step
    block_tables: torch.Tensor  # [rows, max_blocks] int32, padded with -1 (for varlen kernels)
    # Host-side copies for the per-row loop (no device sync per layer):
    row_bounds: list[tuple[int, int, int]]  # per row (q_start, q_end, context_len)
    row_slots: list[torch.Tensor]  # per row: cache slots of positions 0 .. context_len + num_tokens - 1


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
    k_cache, v_cache = paged.kv_cache[module.layer_idx]
    # [1, kv_heads, T, D] -> [T, kv_heads, D], the cache's slot-major layout
    k_cache[paged.slot_mapping] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_cache[paged.slot_mapping] = value[0].transpose(0, 1).to(v_cache.dtype)
    out = _attend_rows(query[0], k_cache, v_cache, paged, scaling, softcap, sliding_window)
    return out.unsqueeze(0), None  # [1, T, heads, D], like eager's transposed output


def _attend_rows(
    query: torch.Tensor,  # [heads, T, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    paged: PagedBatch,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    heads, _, head_dim = query.shape
    n_rep = heads // k_cache.shape[1]
    outs = []
    for (q_start, q_end, ctx), slots in zip(paged.row_bounds, paged.row_slots):
        q = query[:, q_start:q_end]  # [heads, n, D]
        n = q_end - q_start
        # A sliding-window layer never looks further back than the window: gather only what it can see.
        first = max(0, ctx - sliding_window + 1) if sliding_window else 0
        k = k_cache[slots[first:]].transpose(0, 1)  # [kv_heads, L, D]
        v = v_cache[slots[first:]].transpose(0, 1)
        if n_rep > 1:  # GQA: each kv head serves n_rep consecutive query heads (transformers' repeat_kv)
            k = k.repeat_interleave(n_rep, dim=0)
            v = v.repeat_interleave(n_rep, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scaling  # [heads, n, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx, ctx + n, device=q.device)[:, None]
        k_pos = torch.arange(first, ctx + n, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window:  # as masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window
            visible = visible & (k_pos > q_pos - sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append(torch.matmul(probs, v).transpose(0, 1))  # [n, heads, D]
    return torch.cat(outs, dim=0) if outs else query.new_zeros(0, heads, head_dim)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
