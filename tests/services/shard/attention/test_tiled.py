"""The tiled prefill path against transformers: same greedy tokens, and proof that the tiled path ran.

Thresholds are lowered so that the tiny test prompts (a few hundred tokens, some prefilled in several chunks, driven
by the in-process engine, bench/engine.py) take the tiled path in many tiles, with tiles that do not line up with
the pages. The reference is transformers run with
the attention math the tiled path uses: its sdpa implementation, or eager for a soft-capped model (Gemma-2).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from bench.engine import Engine, request
from libs.runtime import cpu
from services.shard import cpu_kernels
from services.shard.attention import paged, tiled
from services.shard.attention.tiled import STATS, eager_tile
from services.shard.model_runner import ModelRunner
from tests.services.shard.attention.test_paged import host_batch
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import ARCHS, CORPUS, SLIDING_WINDOW

BLOCK_SIZE = {"llama": 16, "qwen2": 4, "gemma2": 16, "gemma3": 4}
TILE_MIN, TILE = 16, 24  # tiles of 24 queries straddle pages of 4 and 16
SOFTCAPPED = {"gemma2"}


@functools.lru_cache(maxsize=8)
def _reference_model(model_dir: str, impl: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl).eval()


def _reference(model_dir, arch: str, prompt: list[int], max_new: int) -> list[int]:
    model = _reference_model(str(model_dir), "eager" if arch in SOFTCAPPED else "sdpa")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _long_prompts(model_dir) -> list[list[int]]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(CORPUS.read_text(encoding="utf-8")).ids
    return [ids[:230], ids[700:850], ids[1200:1210], ids[1500:1560]]


def _arrivals(prompts: list[list[int]]) -> dict[int, list]:
    return {
        0: [request("230", prompts[0], 10)],  # 200 tokens, then the last 30 beside the next two
        1: [request("150", prompts[1], 12), request("10", prompts[2], 12)],  # whole; the short one grouped
        2: [request("60", prompts[3], 10)],  # chunks of 20 beside the decodes: tiled, context before the later two
    }


# 200 prompt tokens a step (so the first prompt is cut), 20 while anything decodes
BUDGET = dict(max_batch_prefill_tokens=200, max_prefill_tokens_while_decoding=20)
# the tiled rows (queries, context): tiles of 24 do not line up with the pages, nor with the chunks
TILED_ROWS = [(200, 0), (30, 200), (150, 0), (20, 0), (20, 20), (20, 40)]


def _serve(runner: ModelRunner, model_dir) -> dict[str, list[int]]:
    """Each request's tokens; the tiled rows were those of TILED_ROWS, next to short rows in the same step."""
    engine = Engine.build(runner, model_dir, **BUDGET)
    steps = Steps(engine)
    got = engine.run(_arrivals(_long_prompts(model_dir)))
    assert [(r.fed, r.context) for rows in steps.rows for r in rows if r.fed >= TILE_MIN] == TILED_ROWS
    assert [r.fed for r in steps.rows[1]] == [30, 150, 10]  # the short row on the grouped path, in the same step
    return {rid: out.tokens for rid, out in got.items()}


def _expected_calls(runner, arch: str, rows: list[tuple[int, int]]) -> dict[str, int]:
    """Kernel calls for tiled rows of (queries, context) over every layer: ceil(n / TILE) tiles a row, except a
    full-attention row from position 0, which SDPA runs as one causal call."""
    kernel = "eager" if arch in SOFTCAPPED else "sdpa"
    calls = {}
    for layer in runner.model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None) or 0
        for n, ctx in rows:
            key, count = (kernel, -(-n // TILE)) if window or ctx or kernel == "eager" else ("sdpa-causal", 1)
            calls[key] = calls.get(key, 0) + count
    return calls


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiled, "TILE_MIN_QUERIES", TILE_MIN)
    monkeypatch.setattr(tiled, "TILE_QUERIES", TILE)
    STATS.clear()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiled_prefill_matches_transformers(tiny_dirs, arch, small_tiles):
    model_dir = tiny_dirs[arch]
    prompts = _long_prompts(model_dir)
    assert min(len(p) for p in prompts) > SLIDING_WINDOW and max(len(p) for p in prompts) > 20 * SLIDING_WINDOW
    runner = ModelRunner(str(model_dir), num_blocks=160, block_size=BLOCK_SIZE[arch])
    got = _serve(runner, model_dir)
    assert STATS == _expected_calls(runner, arch, TILED_ROWS)
    for req in (r for reqs in _arrivals(prompts).values() for r in reqs):
        want = _reference(model_dir, arch, req.input_ids.tolist(), req.max_new_tokens)
        assert got[req.request_id] == want, f"{arch} request {req.request_id} (prompt {len(req.input_ids)} tokens)"


def test_a_wrong_window_breaks_equality(tiny_dirs, small_tiles, monkeypatch):
    """The equality above really checks the window: the tiled path with a doubled window gives other tokens."""
    arch = "gemma3"
    model_dir = tiny_dirs[arch]
    build, attend = paged.build_tiled, paged.attend_tiled
    monkeypatch.setattr(paged, "build_tiled", lambda paged, rows, window, dev: build(paged, rows, 2 * window, dev))
    monkeypatch.setattr(paged, "attend_tiled", lambda *a, **kw: attend(*a[:-1], 2 * a[-1], **kw))
    got = _serve(ModelRunner(str(model_dir), num_blocks=160, block_size=BLOCK_SIZE[arch]), model_dir)
    assert STATS["sdpa"] > 0
    requests = [r for reqs in _arrivals(_long_prompts(model_dir)).values() for r in reqs]
    want = [_reference(model_dir, arch, r.input_ids.tolist(), r.max_new_tokens) for r in requests]
    assert [got[r.request_id] for r in requests] != want


def _dense(q, k, v, q_pos: int, window: int, scaling: float, softcap: float | None) -> torch.Tensor:
    """transformers' eager attention over the whole [heads, n, keys] score matrix, keys at positions 0.."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    n, keys = q.shape[1], k.shape[1]
    qp, kp = torch.arange(q_pos, q_pos + n)[:, None], torch.arange(keys)[None, :]
    visible = (kp <= qp) & ((kp > qp - window) if window else True)
    mask = torch.zeros(n, keys).masked_fill(~visible, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[0] // k.shape[0], False
    out, _ = eager_attention_forward(module, q[None], k[None], v[None], mask, scaling=scaling, softcap=softcap)
    return out[0]  # [n, heads, D]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [0, 8, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [0, 21])
@pytest.mark.parametrize("d", [16, 256])
@pytest.mark.parametrize("scaling", [0.3, 0.25])  # a power of two: the half kernel scales the queries instead
@pytest.mark.parametrize("amx", [False, True])
def test_tiles_equal_dense_attention(monkeypatch, softcap, window, dtype, ctx, d, scaling, amx):
    """One row (from position 0, or with context before it), GQA 4:2 (sdpa in float32 and in bfloat16 on a CPU with
    AMX, half GEMMs in bfloat16 without it, eager when soft-capped), against dense eager paged."""
    flags = cpu.flags() | {"amx_bf16"} if amx else cpu.flags() - {"amx_bf16"}
    monkeypatch.setattr(tiled.cpu, "flags", lambda: flags)
    monkeypatch.setattr(tiled, "TILE_MIN_QUERIES", 8)
    monkeypatch.setattr(tiled, "TILE_QUERIES", 13)
    gen = torch.Generator().manual_seed(0)
    bs, n, heads, kv_heads = 4, 50, 4, 2
    blocks = -(-(ctx + n) // bs)
    table = np.random.default_rng(0).permutation(blocks + 3)[:blocks]
    k_cache = torch.randn(kv_heads, blocks + 3, bs, d, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, blocks + 3, bs, d, generator=gen).to(dtype)
    q = (torch.randn(heads, n, d, generator=gen) * 3).to(dtype)
    batch = host_batch(k_cache, v_cache, [n], [ctx], table[None])
    groups, rows = batch.plan(window, torch.device("cpu"))
    assert not groups and len(rows[0].tiles) == -(-n // 13)
    out = torch.full((n, heads, d), float("nan"), dtype=dtype)
    STATS.clear()
    tiled.attend_tiled(q, k_cache, v_cache, rows, out, scaling, softcap, window)
    kernel = "eager" if softcap else "half" if dtype == torch.bfloat16 and not amx else "sdpa"
    assert tiled.choose_kernel(q, softcap) == kernel
    square = not window and not ctx and kernel == "sdpa"
    assert STATS == ({"sdpa-causal": 1} if square else {kernel: -(-n // 13)})
    k = k_cache[:, table].reshape(kv_heads, -1, d)[:, : ctx + n]
    v = v_cache[:, table].reshape(kv_heads, -1, d)[:, : ctx + n]
    want = _dense(q, k, v, ctx, window, scaling, softcap)
    if kernel == "sdpa" and dtype != torch.float32:
        # SDPA keeps the scores in float32 where eager rounds them to bf16: against the float32 math of these inputs
        want = _dense(q.float(), k.float(), v.float(), ctx, window, scaling, softcap).to(dtype)
    tol = (1e-5 if dtype == torch.float32 else 3e-2) * (1 if d == 16 else 2)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    if window:  # the window matters here: a wider one gives other outputs
        assert not torch.allclose(_dense(q, k, v, ctx, window + 3, scaling, softcap), want, atol=tol, rtol=tol)


flash_only = pytest.mark.skipif(
    not (cpu_kernels.load() and torch.ops.switchyard_cpu.flash_attention_ready()),
    reason="the flash kernel needs oneDNN's bf16 brgemm (a CPU with AMX)",
)


@flash_only
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_bf16_runner_prefills_long_rows_by_the_flash_kernel(tmp_path_factory, small_tiles, monkeypatch, arch):
    """A bf16 runner with the C++ kernels prefills the tiled rows by the flash kernel (no SDPA call), through pages,
    chunks and Gemma-3's sliding layers; teacher-forced over every prompt (its tokens' logprobs), it is as close to
    the float32 answer as the SDPA kernel is."""
    from tests.tiny_models import build_model

    model_dir = build_model(tmp_path_factory.mktemp(f"{arch}-heads-of-32"), arch, head_dim=32)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]

    def run(kernel, dtype=torch.bfloat16):
        monkeypatch.setattr(tiled, "KERNEL", kernel)
        runner = ModelRunner(str(model_dir), num_blocks=96, block_size=16, dtype=dtype)
        assert runner.cpu_kernels == (dtype == torch.bfloat16)
        engine = Engine.build(runner, model_dir, **BUDGET)
        STATS.clear()
        arrivals = {
            step: [request(r.request_id, r.input_ids, 1, prompt_logprobs=True) for r in reqs]
            for step, reqs in _arrivals(_long_prompts(model_dir)).items()
        }
        got = engine.run(arrivals)
        return torch.tensor([x for rid in sorted(got) for x in got[rid].prompt_logprobs[1:]]), dict(STATS)

    flash, stats = run(None)
    assert set(stats) == {"flash"} and stats["flash"] >= 2 * layers  # the long rows, every layer: no SDPA call
    sdpa, sdpa_stats = run("sdpa")
    assert "flash" not in sdpa_stats
    exact, _ = run(None, torch.float32)
    assert len(flash) == len(exact) == sum(len(p) - 1 for p in _long_prompts(model_dir))
    flash_err, sdpa_err = (flash - exact).abs().mean(), (sdpa - exact).abs().mean()
    assert flash_err <= 1.25 * sdpa_err, (flash_err, sdpa_err)


@flash_only
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("ctx", [0, 21])
def test_flash_kernel_takes_bf16_rows_where_the_kernels_are_loaded(monkeypatch, window, ctx):
    """In bf16 on AMX with the C++ kernels loaded, each long row is one call of the flash kernel, reading the pages
    the row's table names (shuffled here), and equals the float32 math; without the kernels SDPA serves."""
    monkeypatch.setattr(tiled, "TILE_MIN_QUERIES", 8)
    gen = torch.Generator().manual_seed(0)
    bs, n, heads, kv_heads, d = 16, 150, 4, 2, 64
    blocks = -(-(ctx + n) // bs)
    table = np.random.default_rng(0).permutation(blocks + 3)[:blocks]
    k_cache, v_cache = (torch.randn(kv_heads, blocks + 3, bs, d, generator=gen).bfloat16() for _ in range(2))
    q = (torch.randn(n, heads, d, generator=gen) * 3).bfloat16().transpose(0, 1)
    batch = host_batch(k_cache, v_cache, [n], [ctx], table[None])
    _, rows = batch.plan(window, torch.device("cpu"))
    assert tiled.choose_kernel(q, None, kernels=True) == "flash"
    assert tiled.choose_kernel(q, None) == "sdpa"
    out = torch.full((n, heads, d), float("nan"), dtype=torch.bfloat16)
    STATS.clear()
    tiled.attend_tiled(q, k_cache, v_cache, rows, out, d**-0.5, None, window, kernels=True)
    assert STATS == {"flash": 1}
    k = k_cache[:, table].reshape(kv_heads, -1, d)[:, : ctx + n]
    v = v_cache[:, table].reshape(kv_heads, -1, d)[:, : ctx + n]
    want = _dense(q.float(), k.float(), v.float(), ctx, window, d**-0.5, None).bfloat16()
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_long_context_gets_smaller_tiles(monkeypatch, softcap):
    """A full-attention row whose context makes TILE_QUERIES x keys exceed TILE_SCORES is cut into tiles of
    TILE_SCORES // keys queries (never under TILE_FLOOR); a sliding-window row keeps its tiles; both stay exact."""
    monkeypatch.setattr(tiled, "TILE_MIN_QUERIES", 8)
    monkeypatch.setattr(tiled, "TILE_QUERIES", 16)
    monkeypatch.setattr(tiled, "TILE_SCORES", 16 * 20)
    monkeypatch.setattr(tiled, "TILE_FLOOR", 3)
    gen = torch.Generator().manual_seed(2)
    bs, ctx, n, heads, kv_heads, d = 4, 40, 30, 4, 2, 16
    blocks = -(-(ctx + n) // bs)
    k_cache, v_cache = (torch.randn(kv_heads, blocks, bs, d, generator=gen) for _ in range(2))
    q = torch.randn(heads, n, d, generator=gen) * 3
    batch = host_batch(k_cache, v_cache, [n], [ctx], np.arange(blocks)[None])
    k, v = k_cache.reshape(kv_heads, -1, d), v_cache.reshape(kv_heads, -1, d)
    for window, per_tile in ((0, 16 * 20 // 70), (9, 16)):  # 70 keys: 4 queries a tile; the window keeps 16
        _, rows = batch.plan(window, torch.device("cpu"))
        assert [tile[1] for tile in rows[0].tiles] == [per_tile] * (n // per_tile) + [n % per_tile] * bool(n % per_tile)
        out = torch.full((n, heads, d), float("nan"))
        tiled.attend_tiled(q, k_cache, v_cache, rows, out, 0.3, softcap, window)
        torch.testing.assert_close(out, _dense(q, k, v, ctx, window, 0.3, softcap), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(tiled, "TILE_FLOOR", 6)
    rows = tiled.build_tiled(batch, np.array([0]), 0, torch.device("cpu"))
    assert rows[0].tiles[0][1] == 6  # the floor wins over the score budget


def test_eager_tile_soft_caps():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 8, generator=gen) * 4 for _ in range(3))
    capped = eager_tile(q, k, v, None, 1.0, 2.0)
    assert not torch.allclose(capped, eager_tile(q, k, v, None, 1.0, None))


def test_an_8k_prompt_in_chunks(tiny_dirs, monkeypatch):
    """A long context works at the default tile sizes: 8,192 prompt tokens in chunks of 2,048 (a full-attention
    model, every tile seeing its whole causal prefix), the same greedy tokens as transformers' sdpa; no tile's
    mask is larger than a tile of queries by the context (a real model's peak memory per chunk is measured by
    `python -m bench.kernels.attention --model DIR --chunk 2048`)."""
    arch = "llama"
    model_dir = tiny_dirs[arch]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(CORPUS.read_text(encoding="utf-8")).ids
    prompt = (ids * (-(-8192 // len(ids))))[:8192]
    largest = []
    tile_mask = tiled._tile_mask

    def recording(*args):
        mask = tile_mask(*args)
        largest.append(0 if mask is None else mask.numel())
        return mask

    monkeypatch.setattr(tiled, "_tile_mask", recording)
    STATS.clear()
    runner = ModelRunner(str(model_dir), num_blocks=8192 // 16 + 4, block_size=16)
    engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=2048)
    steps = Steps(engine)
    got = engine.run({0: [request("8k", prompt, 6)]})["8k"].tokens
    assert steps.chunks("8k") == [2048] * 4
    tiles = 3 * -(-2048 // tiled.TILE_QUERIES)  # the first chunk is one causal call
    assert STATS == {"sdpa": tiles * runner.num_layers, "sdpa-causal": runner.num_layers}
    assert max(largest) <= tiled.TILE_QUERIES * len(prompt)
    assert got == _reference(model_dir, arch, prompt, 6)
