"""Phase 1, kernel: the Triton paged attention against the torch path on random paged caches (float32, bf16);
and the paged batches it builds."""

from __future__ import annotations

import math

import numpy as np
import torch

from services.shard.attention.paged import PagedBatch, attend_layer

from .common import sync, timed, triton_module
from .report import Report


def paged_layout(
    context_lens: list[int], num_tokens: list[int], block_size: int, num_blocks: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows' block tables drawn at random from the pool, their new tokens' slots, and cu: the runner's layout."""
    rng = np.random.default_rng(seed)
    need = [math.ceil((c + n) / block_size) for c, n in zip(context_lens, num_tokens)]
    if sum(need) > num_blocks:
        raise ValueError("pool too small for the rows")
    pool = rng.permutation(num_blocks)
    tables = np.full((len(need), max(need)), -1, dtype=np.int64)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = pool[at : at + k]
        at += k
    cu = np.zeros(len(need) + 1, dtype=np.int64)
    np.cumsum(num_tokens, out=cu[1:])
    counts = np.asarray(num_tokens)
    positions = np.arange(cu[-1]) - np.repeat(cu[:-1], counts) + np.repeat(np.asarray(context_lens), counts)
    rows = np.repeat(np.arange(len(need)), counts)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    return tables, slots, cu


def make_paged(kv_cache, tables, slots, cu, context_lens, block_size, dev) -> PagedBatch:
    """The batch the runner would build from these host arrays (PagedBatch.from_host)."""
    return PagedBatch.from_host(kv_cache, slots, cu, np.asarray(context_lens, dtype=np.int64), tables, block_size, dev)


def phase1(rep: Report, dev: torch.device, quick: bool) -> None:
    mod, why = triton_module()
    if mod is None:
        rep.skip(1, "triton paged attention", why)
        return
    if quick:
        heads, kv_heads, dim, bs = 4, 2, 16, 16
        contexts, fed = [0, 5, 17, 40, 3], [7, 1, 1, 12, 1]
        windows, caps = (0, 8), (None, 5.0)
    else:
        heads, kv_heads, dim, bs = 32, 8, 128, 16
        rng = np.random.default_rng(1)
        contexts = [int(c) for c in rng.integers(1, 2048, 60)] + [0, 300, 1000, 64]  # decodes, then prefills
        fed = [1] * 60 + [256, 128, 200, 64]
        windows, caps = (0, 256), (None, 50.0)
    need = sum(math.ceil((c + n) / bs) for c, n in zip(contexts, fed))
    num_blocks = need + 8
    tables, slots, cu = paged_layout(contexts, fed, bs, num_blocks, seed=0)
    total = int(cu[-1])
    tolerance = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device="cpu").manual_seed(0)
        shape = (kv_heads, num_blocks, bs, dim)
        base = [tuple(torch.randn(shape, generator=gen).to(dev, dtype) for _ in "kv")]
        q = torch.randn(total, heads, dim, generator=gen).to(dev, dtype)
        k = torch.randn(total, kv_heads, dim, generator=gen).to(dev, dtype)
        v = torch.randn(total, kv_heads, dim, generator=gen).to(dev, dtype)
        for window in windows:
            for cap in caps:
                name = f"{str(dtype).split('.')[-1]} window={window} softcap={cap}"
                caches = {b: [tuple(t.clone() for t in base[0])] for b in ("torch", "triton")}
                papers = {b: make_paged(caches[b], tables, slots, cu, contexts, bs, dev) for b in caches}
                scale = dim**-0.5
                try:
                    want = attend_layer(0, q, k, v, papers["torch"], scale, cap, window)
                    got = mod.attend_layer_triton(0, q, k, v, papers["triton"], scale, cap, window)
                    sync(dev)
                except Exception as e:  # the kernel's interface or launch: the row says what broke
                    rep.add(1, name, "fail", f"{type(e).__name__}: {e}")
                    continue
                err = (got.float() - want.float()).abs().max().item()
                cache_same = all(torch.equal(a, b) for a, b in zip(caches["torch"][0], caches["triton"][0]))
                ok = err <= tolerance[dtype] and cache_same
                timing = {}
                if dev.type == "cuda" and window == 0 and cap is None:
                    for b, fn in (("torch", attend_layer), ("triton", mod.attend_layer_triton)):
                        call = (0, q, k, v, papers[b], scale, cap, window)
                        timing[f"{b}_ms"] = 1e3 * timed(fn, dev, args=call)
                detail = f"max |Δ| {err:.2e} (tolerance {tolerance[dtype]:.0e}), cache writes equal: {cache_same}"
                detail += "".join(f", {name} {ms:.3f}" for name, ms in timing.items())
                rep.add(1, name, "ok" if ok else "fail", detail, max_abs_err=err, cache_equal=cache_same, **timing)
