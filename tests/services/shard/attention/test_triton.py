"""The Triton paged attention kernel against the torch path, run by Triton's interpreter on CPU.

TRITON_INTERPRET=1 is set before the kernel's module is imported (its functions are decorated as interpreted), so
the kernel runs here without a GPU; the module is skipped only where triton is not installed. Three interpreter
gaps are patched in the harness, not the kernel (tests/triton_interpreter.py): triton's own helpers decorated before the
variable was set, int() of a scalar tensor under numpy 2.4, and dots of bfloat16 operands. Every case poisons the
output with NaN first, so a query the kernel never writes fails; float32 must match the torch path to rounding,
bf16 to bf16's precision, and the pages both paths write must be equal. One tiny model runs end to end with every
layer's attention by the kernel, greedy-equal to generate().
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: @triton.jit reads it at decoration

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from bench.engine import Engine, request  # noqa: E402
from services.shard.attention import paged  # noqa: E402
from services.shard.model_runner import ModelRunner  # noqa: E402
from tests.reference import reference_generate  # noqa: E402
from tests.tiny_models import prompts_for  # noqa: E402
from tests.triton_interpreter import install_interpreter_shims  # noqa: E402

install_interpreter_shims()

from services.shard.attention import triton as triton_kernel  # noqa: E402
from services.shard.attention.triton import attend_layer_triton  # noqa: E402


def _batch(q_lens, ctx_lens, kv_heads, head_dim, block_size, dtype, seed=0):
    """A PagedBatch factory over random pages (rows' blocks shuffled, spare blocks beside them), and its T."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-(c + q) // block_size) for q, c in zip(q_lens, ctx_lens)]
    n_blocks = sum(per_row) + 2
    order = torch.randperm(n_blocks, generator=gen).numpy()
    tables = np.full((len(q_lens), max(per_row) + 1), -1, dtype=np.int64)  # a padding column beyond every row
    start = 0
    for i, n in enumerate(per_row):
        tables[i, :n] = order[start : start + n]
        start += n
    k_cache, v_cache = (torch.randn(kv_heads, n_blocks, block_size, head_dim, generator=gen).to(dtype) for _ in "kv")
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    ctx = np.asarray(ctx_lens, dtype=np.int64)
    positions = np.concatenate([np.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size

    def make(backend: str) -> paged.PagedBatch:
        return paged.PagedBatch(
            kv_cache=[(k_cache.clone(), v_cache.clone())],
            slot_mapping=torch.from_numpy(slots),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
            context_lens=torch.from_numpy(ctx.astype(np.int32)),
            block_tables=torch.from_numpy(tables.astype(np.int32)),
            block_size=block_size,
            host_cu=cu,
            host_context=ctx,
            host_tables=tables,
            backend=backend,
        )

    return make, int(cu[-1])


# (heads, kv_heads, head_dim): GQA 4:1 and 8:1 (32/8 and 8/1 scaled down), 3:1 with a head size not a power of 2
SHAPES = [(8, 2, 64), (8, 1, 128), (4, 1, 256), (6, 2, 80)]
# decodes beside prefill chunks: from position 0, across block boundaries, taller than one query tile
Q_LENS, CTX_LENS = [1, 7, 1, 37, 1, 3], [9, 0, 14, 5, 0, 22]
# (soft-cap, sliding window)
MASKS = [(None, 0), (None, 6), (4.0, 0), (2.5, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"cap{m[0]}-win{m[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{}-{}-{}".format(*s))
def test_matches_the_torch_path(shape, mask, dtype):
    heads, kv_heads, head_dim = shape
    softcap, window = mask
    make, total = _batch(Q_LENS, CTX_LENS, kv_heads, head_dim, block_size=4, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    # the query as the model hands it: a [T, heads, D] view of [1, heads, T, D]
    query = torch.randn(1, heads, total, head_dim, generator=gen).to(dtype)[0].transpose(0, 1)
    key, value = (torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    want_batch, got_batch = make("torch"), make("triton")
    want = paged.attend_layer(0, query, key, value, want_batch, head_dim**-0.5, softcap, window)
    out = torch.full((total, heads, head_dim), float("nan"), dtype=dtype)
    got = attend_layer_triton(0, query, key, value, got_batch, head_dim**-0.5, softcap, window, out=out)
    assert got is out and not got.isnan().any()
    # bf16: the torch path rounds the probabilities to bf16 before P @ V, the kernel normalizes in float32 after
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    for (k_want, v_want), (k_got, v_got) in zip(want_batch.kv_cache, got_batch.kv_cache):  # the same pages
        assert torch.equal(k_want, k_got) and torch.equal(v_want, v_got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"cap{m[0]}-win{m[1]}")
def test_split_kv_matches_the_torch_path(mask, dtype):
    """Segments of the keys, each its own program, combined by a second kernel: decodes over long contexts (several
    key tiles a segment, some segments empty under a window) beside a short prefill chunk."""
    softcap, window = mask
    make, total = _batch([1, 1, 9, 1], [150, 301, 20, 70], kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(total, 8, 64, generator=gen).to(dtype)
    key, value = (torch.randn(total, 2, 64, generator=gen).to(dtype) for _ in "kv")
    want = paged.attend_layer(0, query, key, value, make("torch"), 0.125, softcap, window)
    out = torch.full((total, 8, 64), float("nan"), dtype=dtype)
    got = attend_layer_triton(0, query, key, value, make("triton"), 0.125, softcap, window, out=out, segments=4)
    assert not got.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_split_kv_only_for_few_one_tile_rows_over_long_contexts():
    make, _ = _batch([1, 1], [5000, 40], kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    assert triton_kernel.split_segments(make("triton"), 4) == 8  # segments of at least SPLIT_MIN_KEYS (512) keys
    assert triton_kernel.split_segments(make("triton"), None) == 1  # rows of several query tiles
    assert triton_kernel.split_segments(make("triton"), triton_kernel.SPLIT_PROGRAMS) == 1  # a full launch
    short, _ = _batch([1, 1], [700, 40], kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    assert triton_kernel.split_segments(short("triton"), 4) == 1  # segments would hold too few keys


def test_dispatches_on_the_backend_and_handles_page_size_16():
    """attend_layer runs the kernel for backend "triton"; pages of 16, one row much longer than the others."""
    # the 130-query row takes the torch path's tiled kernel (tiled.py), the others its grouped one
    make, total = _batch([1, 130, 2], [50, 3, 17], kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(total, 8, 64, generator=gen)
    key, value = (torch.randn(total, 2, 64, generator=gen) for _ in "kv")
    want = paged.attend_layer(0, query, key, value, make("torch"), 0.125, None, 0)
    got = paged.attend_layer(0, query, key, value, make("triton"), 0.125, None, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scores_far_below_zero_after_keys_a_query_cannot_see():
    """A sliding window over a tall tile: a later query sees none of the first key tile, then only scores far
    below zero (exp(s) would underflow against a stand-in maximum of 0); its softmax must still be its own."""
    make, total = _batch([60], [0], kv_heads=4, head_dim=64, block_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(total, 4, 64, generator=gen)
    key, value = (torch.randn(total, 4, 64, generator=gen) for _ in "kv")
    want = paged.attend_layer(0, query, key, value, make("torch"), 40.0, None, 5)
    got = paged.attend_layer(0, query, key, value, make("triton"), 40.0, None, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backend_choice():
    assert paged.attention_backend("auto", torch.device("cpu")) == "torch"
    assert paged.attention_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="attention must be"):
        paged.attention_backend("flash", torch.device("cpu"))


def test_greedy_matches_generate_through_the_kernel(tiny_dirs, monkeypatch):
    """gemma2 (GQA, soft-cap, sliding and global layers) end to end with every layer's attention by the kernel: two
    prompts prefilled in one step, a third chunked beside their decodes, greedy-equal to transformers' generate()."""
    calls = []
    launch = triton_kernel.attend_layer_triton
    monkeypatch.setattr(triton_kernel, "attend_layer_triton", lambda *a, **k: calls.append(1) or launch(*a, **k))
    model_dir = tiny_dirs["gemma2"]
    prompts = prompts_for(model_dir)
    runner = ModelRunner(str(model_dir), num_blocks=24, block_size=16, attention="triton")
    assert runner.attention == "triton"
    arrivals = {0: [request("a", prompts[1], 6), request("b", prompts[3], 6)], 1: [request("c", prompts[2], 4)]}
    got = Engine.build(runner, model_dir, max_prefill_tokens_while_decoding=16).run(arrivals)
    assert len(calls) >= 2 * runner.num_layers * 4  # every layer of every step
    for req in (r for reqs in arrivals.values() for r in reqs):
        want = reference_generate(model_dir, req.input_ids.tolist(), req.max_new_tokens)
        assert got[req.request_id].tokens == want, f"request {req.request_id}"
