"""The LoRA products of one step (services/shard/lora/products.py) on small random matrices: the step's rows
grouped by adapter slot, the grouped shrink and expand against each token's own adapter row by row (base rows
untouched bit for bit), and tensor-parallel slices summing to the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.shard.lora.products import BASE, expand, group_rows, shrink


def test_group_rows_orders_adapter_tokens_by_slot():
    g = group_rows([BASE, 0, 0, 1, BASE, 1], [2, 3, 1, 2, 4, 1])
    assert g.num_tokens == 13 and g.count == 7
    assert g.order.tolist() == [2, 3, 4, 5, 6, 7, 12] and g.segments == [(0, 0, 4), (1, 4, 7)]
    assert [(s, r if isinstance(r, slice) else r.tolist()) for s, r in g.groups] == [(0, [2, 3, 4, 5]), (1, [6, 7, 12])]
    interleaved = group_rows([1, 0, BASE, 1, 0])
    assert interleaved.order.tolist() == [1, 4, 0, 3] and interleaved.segments == [(0, 0, 2), (1, 2, 4)]
    # adapter tokens in one run already ordered by slot: a slice, no gather or scatter
    run = group_rows([BASE, 2, 2, 3, BASE], [1, 2, 1, 3, 2])
    assert run.order == slice(1, 7) and run.segments == [(2, 0, 3), (3, 3, 6)]
    assert group_rows([BASE, BASE]).segments == [] and group_rows([BASE, BASE]).count == 0


def reference_delta(x, slots_per_token, weights):
    """Row by row: x[t] @ A.T @ B.T of the token's own adapter (none for base tokens and absent slots)."""
    out = torch.zeros(x.shape[0], next(iter(weights.values()))[1].shape[0])
    for t, slot in enumerate(slots_per_token):
        if slot in weights:
            a, b = weights[slot]
            out[t] = (x[t] @ a.T.to(x.dtype)) @ b.T.to(x.dtype)
    return out


def _apply(x, y, groups, weights, reduce=None):
    """One layer alone: its shrink (every slot's A) and its expand (the whole shrink's columns, B.T)."""
    shrunk = shrink(x, groups, {s: a for s, (a, _) in weights.items()}, reduce)
    return expand(y, groups, shrunk, {s: (0, a.shape[0], b.T.contiguous()) for s, (a, b) in weights.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_equal_each_tokens_own_adapter(dtype):
    """Interleaved rows (a gather and a scatter), one run (a slice), base rows untouched bit for bit, adapters of
    different ranks, one loaded but absent from the step, one whose B is absent here (its rows keep the base);
    in float32 and in bfloat16."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 12, generator=gen), torch.randn(10, 12, generator=gen)
    weights = {s: (torch.randn(r, 12, generator=gen), torch.randn(10, r, generator=gen)) for s, r in
               ((0, 4), (2, 3), (5, 6))}  # fmt: skip
    for slots, counts in (([2, BASE, 0, 2, 0], [2, 2, 1, 3, 1]), ([BASE, 0, 0, 2], [2, 3, 1, 3])):
        groups = group_rows(slots, counts)
        per_token = np.repeat(slots, counts).tolist()
        base = (x @ w.T).to(dtype)
        got = _apply(
            x.to(dtype), base.clone(), groups, {s: (a.to(dtype), b.to(dtype)) for s, (a, b) in weights.items()}
        )
        want = base.float() + reference_delta(x.float(), per_token, weights)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
        on_base = [t for t, s in enumerate(per_token) if s == BASE]
        assert torch.equal(got[on_base], base[on_base]) and not torch.equal(got, base)
    # slot 2 has an A (the shared shrink of a sibling) but no B in this layer: its rows keep the base output
    groups = group_rows([2, 0], [2, 2])
    shrunk = shrink(x[:4], groups, {s: a for s, (a, _) in weights.items()})
    a0, b0 = weights[0]
    got = expand(x[:4] @ w.T, groups, shrunk, {0: (0, a0.shape[0], b0.T.contiguous())})
    torch.testing.assert_close(got[:2], x[:2] @ w.T, atol=0, rtol=0)
    torch.testing.assert_close(got[2:], x[2:4] @ w.T + (x[2:4] @ a0.T) @ b0.T)


def test_tensor_parallel_slices_sum_to_the_whole():
    """Column-parallel: each rank's B rows give its output columns; row-parallel: each rank's A columns give a
    partial shrink, and the summed shrinks expand to the whole delta (what the all-reduce does across ranks)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 12, generator=gen), torch.randn(10, 12, generator=gen)
    a, b = torch.randn(4, 12, generator=gen), torch.randn(10, 4, generator=gen)
    a2, b2 = torch.randn(3, 12, generator=gen), torch.randn(10, 3, generator=gen)
    groups = group_rows([0, BASE, 1, 0], [2, 2, 1, 2])
    weights = {0: (a, b), 1: (a2, b2)}
    whole = _apply(x, x @ w.T, groups, weights)
    cols = [_apply(x, x @ w[o : o + 5].T, groups, {s: (aa, bb[o : o + 5]) for s, (aa, bb) in weights.items()})
            for o in (0, 5)]  # fmt: skip
    torch.testing.assert_close(torch.cat(cols, dim=1), whole)
    # rank 0 holds inputs 0..5, rank 1 inputs 6..11; the all-reduce adds rank 1's shrinks to rank 0's
    rank1 = shrink(x[:, 6:], groups, {s: aa[:, 6:] for s, (aa, _) in weights.items()})
    flat1 = torch.cat([t.reshape(-1) for t in rank1.values()])
    rank0 = _apply(x[:, :6], x @ w.T, groups, {s: (aa[:, :6], bb) for s, (aa, bb) in weights.items()},
                   reduce=lambda t: t + flat1)  # fmt: skip
    torch.testing.assert_close(rank0, whole)
