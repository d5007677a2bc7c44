"""The C++ kernels (services/shard/cpu_kernels/) against the torch ops they replace: the norms, the rotary embedding
and SiLU x up bit for bit in bf16 (they round where the ops round), GELU within an ulp, the attention of short rows
against float64 math over the same pages (rows of one and of several tokens, sliding windows, soft-cap, GQA, head
dimensions with and without a compiled-in size); the build is keyed by the CPU and cached, and a build that fails
says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from services.shard import cpu_kernels
from services.shard.model import decoder_walk as walk

ops = torch.ops.switchyard_cpu


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_kernels.load(), cpu_kernels.reason()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- norms -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "gemma,add", [(False, "none"), (False, "plain"), (True, "none"), (True, "plain"), (True, "normed")]
)  # only Gemma norms what it adds
# the sum's order: a short row, one with vectors and values left over, one carry, several (ATen's cascade)
@pytest.mark.parametrize("N", [96, 124, 640, 2304])
def test_add_rms_norm_equals_the_torch_ops(dtype, gemma, add, N):
    g = _gen()
    T = 64
    h = (torch.randn(T, N, generator=g) * 2).to(dtype)
    y = (torch.randn(T, N + 5, generator=g) * 3).to(dtype)[:, :N]  # a row stride of its own, as a product's column
    w = torch.randn(N, generator=g) * 0.3
    spec = (1.0 + w, 1e-6, True) if gemma else (w.to(dtype), 1e-5, False)
    y_spec = (1.0 + torch.randn(N, generator=g) * 0.3, 1e-6, True) if add == "normed" else None
    want_h = h.clone()
    if add != "none":
        want_h.add_(y if y_spec is None else walk._norm(y, y_spec))
    want = walk._norm(want_h, spec)
    got_h = h.clone()
    got = ops.add_rms_norm(
        got_h, None if add == "none" else y, spec[0], spec[1], gemma,
        None if y_spec is None else y_spec[0], 0.0 if y_spec is None else y_spec[1],
    )  # fmt: skip
    assert torch.equal(got_h, want_h)
    assert torch.equal(got, want)


def test_add_rms_norm_refuses_what_it_cannot_read():
    h = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 for Gemma"):
        ops.add_rms_norm(h, None, torch.ones(8, dtype=torch.bfloat16), 1e-6, True, None, 0.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.add_rms_norm(h.t(), None, torch.ones(4, dtype=torch.bfloat16), 1e-6, False, None, 0.0)


# ---- rotary ----------------------------------------------------------------------------------------------------
def _tables(T: int, D: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and rotate_half-signed sin [T, 1, D], as the walk forms them (`DecoderWalk._ropes`)."""
    angle = (torch.rand(T, 1, D // 2, generator=g) * 20).repeat(1, 1, 2)
    sin = angle.sin()
    return angle.cos().to(dtype), torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [None, "per head", "shared"])
def test_rotary_equals_the_torch_ops_in_place(dtype, norm):
    g = _gen(1)
    T, H, KV, D = 5, 6, 2, 32
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)  # one fused product: q, k, v side by side
    qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
    cos, sin = _tables(T, D, dtype, g)
    weight = {None: None, "per head": 1 + torch.randn(H + KV, D, generator=g) * 0.2}.get(norm)
    if norm == "shared":
        weight = 1 + torch.randn(D, generator=g) * 0.2
    x = qk.clone()
    want = walk._rotate(walk._head_norm(x, weight, 1e-6) if weight is not None else x, (cos, sin))
    got = qkv.clone()
    ops.rotary_(got[:, : (H + KV) * D].view(T, H + KV, D), cos, sin, weight, 1e-6)
    assert torch.equal(got[:, : (H + KV) * D].view(T, H + KV, D), want)
    assert torch.equal(got[:, (H + KV) * D :], qkv[:, (H + KV) * D :])  # v untouched


# ---- gated activation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_equals_the_torch_ops(dtype):
    g = _gen(2)
    gate_up = (torch.randn(9, 2 * 200, generator=g) * 4).to(dtype)  # one product: gate then up
    gate, up = gate_up[:, :200], gate_up[:, 200:]
    silu = torch.nn.functional.silu(gate).mul_(up)
    assert torch.equal(ops.gated(gate, up, 0), silu)
    gelu = torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)
    got = ops.gated(gate, up, 1)
    # the tanh is ours, not ATen's: an ulp of GELU before the product, two after it; in the far negative tail both
    # lose 1 + tanh to cancellation alike, so the absolute term
    torch.testing.assert_close(got.float(), gelu.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    assert (got == gelu).float().mean() > 0.9
    with pytest.raises(RuntimeError, match="act"):
        ops.gated(gate, up, 2)


def test_the_walk_knows_which_activations_the_kernel_has():
    import functools

    assert walk._kernel_act(torch.nn.functional.silu) == 0
    assert walk._kernel_act(functools.partial(torch.nn.functional.gelu, approximate="tanh")) == 1
    assert walk._kernel_act(torch.nn.functional.gelu) is None  # exact GELU: the torch ops
    assert walk._kernel_act(torch.nn.ReLU()) is None


# ---- attention -------------------------------------------------------------------------------------------------
def _pages(KV: int, blocks: int, bs: int, D: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(KV, blocks, bs, D, generator=g).to(dtype) for _ in "kv")


def _reference(q, k_cache, v_cache, tables, token_rows, positions, tokens, scale, softcap, window):
    """float64 attention of `tokens` over the pages (their K/V already in), one token at a time."""
    T, H, D = q.shape
    KV, _, bs, _ = k_cache.shape
    rep = H // KV
    out = {}
    for t in tokens:
        r, p = int(token_rows[t]), int(positions[t])
        first = max(0, p + 1 - window) if window else 0
        pos = np.arange(first, p + 1)
        blocks = tables[r, pos // bs].long()
        keys = k_cache[:, blocks, torch.from_numpy(pos % bs)].double()  # [KV, L, D]
        values = v_cache[:, blocks, torch.from_numpy(pos % bs)].double()
        qt = q[t].double().view(KV, rep, D)
        s = torch.einsum("grd,gld->grl", qt, keys) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[t] = torch.einsum("grl,gld->grd", s.softmax(-1), values).reshape(H, D)
    return out


def _step(n_q: list[int], context: list[int], bs: int, blocks: int, g):
    """Row bounds, block tables (shuffled blocks) and each token's slot, row and position for a step."""
    cu = np.concatenate([[0], np.cumsum(n_q)])
    need = [-(-(c + n) // bs) for c, n in zip(context, n_q)]
    order = torch.randperm(blocks, generator=g).numpy()
    tables = np.full((len(n_q), max(need)), -1, dtype=np.int64)
    used = 0
    for r, k in enumerate(need):
        tables[r, :k] = order[used : used + k]
        used += k
    token_rows = np.repeat(np.arange(len(n_q)), n_q)
    positions = np.asarray(context)[token_rows] + np.arange(cu[-1]) - cu[token_rows]
    slots = tables[token_rows, positions // bs] * bs + positions % bs
    return cu, tables, token_rows, positions, slots


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,D,window,softcap",
    [
        (torch.bfloat16, 6, 2, 64, 0, 0.0),
        (torch.bfloat16, 4, 1, 256, 0, 0.0),  # Gemma-3's shape
        (torch.bfloat16, 4, 2, 80, 9, 0.0),  # no compiled-in size; a sliding window shorter than the context
        (torch.float16, 4, 4, 128, 0, 5.0),  # soft-cap (Gemma-2)
        (torch.float32, 6, 3, 64, 5, 0.0),
    ],
)
def test_attention_of_short_rows_matches_float64(dtype, heads, kv_heads, D, window, softcap):
    g = _gen(3)
    bs, blocks = 4, 64
    n_q, context = [1, 3, 1, 16, 2], [17, 5, 0, 9, 30]
    cu, tables, token_rows, positions, slots = _step(n_q, context, bs, blocks, g)
    T = int(cu[-1])
    k_cache, v_cache = _pages(kv_heads, blocks, bs, D, dtype, g)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g).to(dtype)  # strided q/k/v, as the walk's
    q = qkv[:, : heads * D].view(T, heads, D)
    k = qkv[:, heads * D : (heads + kv_heads) * D].view(T, kv_heads, D)
    v = qkv[:, (heads + kv_heads) * D :].view(T, kv_heads, D)
    i32 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int32))  # noqa: E731
    out = torch.full((T, heads, D), float("nan"), dtype=dtype)
    attended = [t for t in range(T) if token_rows[t] in (0, 1, 3)]  # rows 2 and 4: left to another path
    ops.attend_short_rows(
        q, k, v, k_cache, v_cache, torch.from_numpy(slots), i32(tables), i32(token_rows), i32(positions),
        i32(attended), True, out, D**-0.5, softcap, window,
    )  # fmt: skip
    for t in attended:  # the attended tokens' K/V are in their slots; the others' are not
        block, offset = divmod(int(slots[t]), bs)
        assert torch.equal(k_cache[:, block, offset], k[t]) and torch.equal(v_cache[:, block, offset], v[t])
    others = [t for t in range(T) if t not in attended]
    assert not any(torch.equal(k_cache[:, s // bs, s % bs], k[t]) for t, s in ((t, int(slots[t])) for t in others))
    assert torch.isnan(out[others]).all()  # written only at the attended tokens
    want = _reference(q, k_cache, v_cache, torch.from_numpy(tables), token_rows, positions, attended, D**-0.5,
                      softcap, window)  # fmt: skip
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for t in attended:
        torch.testing.assert_close(out[t].double(), want[t], atol=tol, rtol=tol)


def test_a_token_attends_alike_in_a_row_of_several_and_alone():
    """A verified draft's token gets exactly what its decode would: the kernel computes each token by itself."""
    g = _gen(4)
    bs, blocks, H, KV, D = 4, 32, 4, 2, 64
    cu, tables, token_rows, positions, slots = _step([5], [11], bs, blocks, g)
    k_cache, v_cache = _pages(KV, blocks, bs, D, torch.bfloat16, g)
    q, k, v = (torch.randn(5, n, D, generator=g).to(torch.bfloat16) for n in (H, KV, KV))
    i32 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int32))  # noqa: E731
    several = torch.empty(5, H, D, dtype=torch.bfloat16)
    ops.attend_short_rows(q, k, v, k_cache, v_cache, torch.from_numpy(slots), i32(tables), i32(token_rows),
                          i32(positions), i32(range(5)), True, several, 0.125, 0.0, 0)  # fmt: skip
    alone = torch.empty(1, H, D, dtype=torch.bfloat16)  # the last token as a decode, the others cached
    ops.attend_short_rows(q[4:], k[4:], v[4:], k_cache, v_cache, torch.from_numpy(slots[4:]), i32(tables),
                          i32([0]), i32(positions[4:]), i32([0]), True, alone, 0.125, 0.0, 0)  # fmt: skip
    assert torch.equal(alone[0], several[4])


# ---- build -----------------------------------------------------------------------------------------------------
def test_the_build_is_keyed_by_the_cpu_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path))
    here = cpu_kernels.build_dir()
    assert here.parent == tmp_path / "cpu_kernels"
    monkeypatch.setattr(cpu_kernels.cpu, "flags", lambda: frozenset({"fpu", "sse2", "avx2"}))
    assert cpu_kernels.build_dir() != here  # another CPU never loads this one's -march=native build
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({cpu_kernels.build_dir(), here}) == 2


def _load_in_a_new_process(cache=None, flags=None) -> dict:
    code = (
        "import json, sys, time; from services.shard import cpu_kernels as k\n"
        + (f"k.FLAGS = {flags!r}\n" if flags else "")
        + "t = time.perf_counter(); ok = k.load()\n"
        "print(json.dumps({'ok': ok, 'reason': k.reason(), 's': time.perf_counter() - t,"
        " 'dir': str(k.build_dir())}))"
    )
    env = dict(os.environ, **({"SWITCHYARD_CACHE": str(cache)} if cache else {}))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_the_cached_build():
    """This process built (or found) the library in the model cache; a new process loads that same file."""
    library = next(cpu_kernels.build_dir().glob("*.so"))
    built = library.stat().st_mtime_ns
    got = _load_in_a_new_process()
    assert got["ok"] and got["dir"] == str(cpu_kernels.build_dir())
    assert library.stat().st_mtime_ns == built  # loaded, not rebuilt (the seconds are measured, not asserted)


def test_a_failed_build_says_why_and_the_torch_ops_serve(tmp_path):
    got = _load_in_a_new_process(tmp_path, flags=["-O3", "-mno-such-flag"])
    assert got["ok"] is False and "error" in got["reason"] and "mno-such-flag" in got["reason"]


def test_long_rows_are_attended_in_parts_and_merged():
    """A token with more keys than a part is split over the threads and merged (flash-decoding): the same values as
    float64, and a short token beside it gets exactly what it gets in a step of its own."""
    g = _gen(5)
    bs, blocks, H, KV, D = 16, 200, 6, 2, 64
    n_q, context = [1, 1, 2], [1500, 7, 1100]
    cu, tables, token_rows, positions, slots = _step(n_q, context, bs, blocks, g)
    assert int(context[0]) > 2 * 512  # three parts
    k_cache, v_cache = _pages(KV, blocks, bs, D, torch.bfloat16, g)
    q, k, v = (torch.randn(4, n, D, generator=g).to(torch.bfloat16) for n in (H, KV, KV))
    i32 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int32))  # noqa: E731
    out = torch.empty(4, H, D, dtype=torch.bfloat16)
    ops.attend_short_rows(q, k, v, k_cache, v_cache, torch.from_numpy(slots), i32(tables), i32(token_rows),
                          i32(positions), i32(range(4)), True, out, D**-0.5, 0.0, 0)  # fmt: skip
    want = _reference(q, k_cache, v_cache, torch.from_numpy(tables), token_rows, positions, range(4), D**-0.5, 0.0, 0)
    for t in range(4):
        torch.testing.assert_close(out[t].double(), want[t], atol=1e-2, rtol=1e-2)
    alone = torch.empty(1, H, D, dtype=torch.bfloat16)  # row 1's token in a step with no long token
    ops.attend_short_rows(q[1:2], k[1:2], v[1:2], k_cache, v_cache, torch.from_numpy(slots[1:2]), i32(tables[1:2]),
                          i32([0]), i32(positions[1:2]), i32([0]), True, alone, D**-0.5, 0.0, 0)  # fmt: skip
    assert torch.equal(alone[0], out[1])
