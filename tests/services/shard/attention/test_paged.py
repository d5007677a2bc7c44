"""How a step's short rows are grouped for attention: decodes keep the one-query product beside verified drafts;
the cpu backend writes the step's K/V by the kernel."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from services.shard import cpu_kernels
from services.shard.attention import paged


def host_batch(k_cache, v_cache, q_lens, ctx_lens, tables) -> paged.PagedBatch:
    """A PagedBatch of one layer's pages from host arrays alone (what planning and the CPU paths read): rows of
    `q_lens` queries after `ctx_lens` tokens, their block `tables` ([rows, max_blocks], -1 padded)."""
    return paged.PagedBatch(
        kv_cache=[(k_cache, v_cache)],
        slot_mapping=None,
        cu_seqlens_q=None,
        context_lens=None,
        block_tables=None,
        block_size=k_cache.shape[2],
        host_cu=np.concatenate([[0], np.cumsum(q_lens)]),
        host_context=np.array(ctx_lens),
        host_tables=np.asarray(tables, dtype=np.int64),
    )


def _batch(q_lens, ctx_lens, bs=4, kv_heads=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-(c + q) // bs) for q, c in zip(q_lens, ctx_lens)]
    tables = np.full((len(q_lens), max(per_row)), -1, dtype=np.int64)
    start = 0
    for i, n in enumerate(per_row):
        tables[i, :n] = np.arange(start, start + n)
        start += n
    k_cache, v_cache = (torch.randn(kv_heads, start, bs, d, generator=gen) for _ in range(2))
    return host_batch(k_cache, v_cache, q_lens, ctx_lens, tables), k_cache, v_cache, tables


def test_decodes_keep_the_one_query_group_beside_a_verified_draft():
    q_lens, ctx_lens = [1, 1, 5, 1, 1, 1], [30, 33, 31, 29, 35, 34]  # row 2 verifies 4 drafts
    batch, k_cache, v_cache, tables = _batch(q_lens, ctx_lens)
    groups, tiled = batch.plan(0, torch.device("cpu"))
    assert not tiled
    one_query = [g for g in groups if g.queries == 1]
    assert len(one_query) == 1 and one_query[0].rows == 5 and not one_query[0].whole
    assert sorted(g.rows for g in groups if g.queries > 1) == [1]

    heads, d = 4, k_cache.shape[-1]
    tokens = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(1))
    out = paged.attend(tokens, k_cache, v_cache, groups, 0.3, None)
    # each row alone, by eager attention's math over its own keys (GQA: query head h reads KV head h // 2)
    cu = batch.host_cu
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        blocks = torch.from_numpy(tables[i][tables[i] >= 0])
        k = k_cache.index_select(1, blocks).reshape(2, -1, d)[:, : c + q].repeat_interleave(2, 0)
        v = v_cache.index_select(1, blocks).reshape(2, -1, d)[:, : c + q].repeat_interleave(2, 0)
        qs = tokens[cu[i] : cu[i + 1]].transpose(0, 1)  # [heads, q, D]
        scores = qs @ k.transpose(1, 2) * 0.3
        causal = torch.arange(c + q)[None, :] > (c + torch.arange(q))[:, None]
        want = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], want.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_a_step_of_decodes_alone_is_one_whole_group():
    batch, *_ = _batch([1, 1, 1], [10, 20, 12])
    groups, _ = batch.plan(0, torch.device("cpu"))
    assert len(groups) == 1 and groups[0].whole and groups[0].rows == 3


def test_the_cpu_backend_writes_kv_by_the_kernel_as_index_copy_would():
    """backend "cpu" (the runner loaded the C++ kernels): a prefill's K/V go in by cpu_kernels' write_kv, into the
    same slots with the same values as the torch backend's index_copy_."""
    assert cpu_kernels.load(), cpu_kernels.reason()
    gen = torch.Generator().manual_seed(4)
    bs, blocks, kv_heads, d, tokens = 4, 12, 2, 8, 37
    pages = {way: [torch.zeros(kv_heads, blocks, bs, d, dtype=torch.bfloat16) for _ in range(2)] for way in "ab"}
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    key, value = (torch.randn(tokens, kv_heads, d, generator=gen).bfloat16() for _ in range(2))
    before = paged.WRITES.copy()
    for way, backend in (("a", "cpu"), ("b", "torch")):
        batch = replace(host_batch(*pages[way], [tokens], [0], [list(range(blocks))]), slot_mapping=slots)
        paged.write_kv(0, key, value, replace(batch, backend=backend))
    assert paged.WRITES["kernel"] - before["kernel"] == 1
    assert paged.WRITES["index_copy"] - before["index_copy"] == 1
    assert torch.equal(pages["a"][0], pages["b"][0]) and torch.equal(pages["a"][1], pages["b"][1])
    assert pages["a"][0].abs().sum() > 0  # something was written
