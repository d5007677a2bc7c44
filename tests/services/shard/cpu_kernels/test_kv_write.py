"""The K/V write (services/shard/cpu_kernels/kv_write.cpp) against `index_copy_`, the torch op it replaces: the same
pages byte for byte, whatever the dtype and the layout of the step's K/V; slots outside the pages and mismatched
tensors are refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from services.shard import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_kernels.load(), cpu_kernels.reason()


def _pages(kv_heads, slots, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(kv_heads, slots, d, generator=g).to(dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 300])  # a decode, a short row, a prefill split over the threads
@pytest.mark.parametrize("fused", [False, True])  # K and V as views into one projection's output (strided tokens)
def test_write_kv_equals_index_copy(dtype, tokens, fused):
    kv_heads, slots, d = 3, 512, 64
    k_flat, v_flat = _pages(kv_heads, slots, d, dtype, seed=1)
    want_k, want_v = k_flat.clone(), v_flat.clone()
    g = torch.Generator().manual_seed(2)
    slot = torch.randperm(slots, generator=g)[:tokens]
    if fused:
        kv = torch.randn(tokens, 2 * kv_heads, d, generator=g).to(dtype)
        key, value = kv[:, :kv_heads], kv[:, kv_heads:]
    else:
        key, value = (torch.randn(tokens, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    torch.ops.switchyard_cpu.write_kv(k_flat, v_flat, slot, key, value)
    want_k.index_copy_(1, slot, key.transpose(0, 1))
    want_v.index_copy_(1, slot, value.transpose(0, 1))
    assert torch.equal(k_flat, want_k) and torch.equal(v_flat, want_v)
    assert torch.equal(k_flat[:, slot[-1]], key[-1])  # it wrote: the last token's slot holds its key


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(slot=512), "outside the pages"),
        (dict(slot=-1), "outside the pages"),
        (dict(dtype=torch.float16), "share a dtype"),
        (dict(heads=2), "heads and D"),
        (dict(slots_dtype=torch.int32), "int64"),
    ],
)
def test_bad_writes_are_refused_and_write_nothing(bad, message):
    k_flat, v_flat = _pages(3, 512, 64, torch.bfloat16, seed=1)
    before = k_flat.clone()
    key = value = torch.ones(2, bad.get("heads", 3), 64, dtype=bad.get("dtype", torch.bfloat16))
    slot = torch.tensor([5, bad.get("slot", 6)], dtype=bad.get("slots_dtype", torch.int64))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.switchyard_cpu.write_kv(k_flat, v_flat, slot, key, value)
    assert torch.equal(k_flat, before)
