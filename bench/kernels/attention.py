"""Prefill attention kernels against each other: one layer's attention for one prompt of n tokens, and a model's.

Why the shard runs long prefill rows the way it does (services/shard/attention/tiled.py). Candidates, each reading
its keys from the paged cache as the shard does: `eager-whole` (the grouped path's whole [heads, n, n] scores),
the tiled path's kernels (`eager-tiles`, `sdpa-tiles`, `half-tiles` in bf16/fp16, `flash` in bf16 on AMX: one
call a row, services/shard/cpu_kernels/flash_attention.cpp), one SDPA call for the row
(`sdpa-row`) and, with `--flex`, torch.compile'd FlexAttention; interleaved, each one's median and its time
relative to `sdpa-tiles`. `--model DIR`: the same at that model's attention shape, beside its whole prefill on the
shard's path (bench/engine.py); with `--chunk`, the prompt in chunks with each chunk's forward and the peak RSS.

    python -m bench.kernels.attention [--n 512,2048,8192] [--dtype float32,bfloat16] [--flex] [--cpu-time]
    python -m bench.kernels.attention --model DIR --n 8192 [--chunk 2048] --dtype float32
    python -m bench.kernels.attention --n 2048 --dtype bfloat16 --ways flash   # one candidate alone, warm
"""

from __future__ import annotations

import argparse
import json
import os

from bench import clock, machine

# (heads, kv heads, head dim, sliding window of its local layers, scaling, soft-cap)
SHAPES = {
    "gemma3-270m": (4, 1, 256, 512, 256**-0.5, None),
    "llama-64": (9, 3, 64, 0, 64**-0.5, None),  # SmolLM2-135M-like: a small-body model, no sliding window
}
EAGER_WHOLE_MAX_BYTES = 2**28  # fp32 scores; skip the whole score matrix beyond this (the reason the tiled path exists)


def model_shape(model_dir: str) -> tuple:
    """A model's attention shape, as SHAPES holds them, from its config."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scaling = (getattr(cfg, "query_pre_attn_scalar", None) or head_dim) ** -0.5
    window = getattr(cfg, "sliding_window", None) or 0
    return (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, window, scaling,
            getattr(cfg, "attn_logit_softcapping", None))  # fmt: skip


def _case(n: int, shape: tuple, dtype, block_size: int = 16):
    """A one-row prefill of n tokens (context 0) over a random paged cache, as the shard's attention sees it."""
    import numpy as np
    import torch

    from services.shard.attention.paged import PagedBatch

    heads, kv_heads, d = shape[:3]
    gen = torch.Generator().manual_seed(0)
    blocks = -(-n // block_size)
    k_cache = torch.randn(kv_heads, blocks, block_size, d, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, block_size, d, generator=gen).to(dtype)
    query = torch.randn(heads, n, d, generator=gen).to(dtype)
    table = np.random.default_rng(0).permutation(blocks)[None].astype(np.int64)
    paged = PagedBatch(kv_cache=[(k_cache, v_cache)], slot_mapping=None, cu_seqlens_q=None, context_lens=None,
                       block_tables=None, block_size=block_size, host_cu=np.array([0, n]), host_context=np.array([0]),
                       host_tables=table)  # fmt: skip
    return query, k_cache, v_cache, torch.from_numpy(table[0]), paged


def candidates(n: int, shape: tuple, dtype, window: int, flex: bool, sweep: bool) -> tuple[dict, float | None]:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from services.shard.attention import tiled

    heads, kv_heads, d, _, scaling, softcap = shape
    query, k_cache, v_cache, table, paged = _case(n, shape, dtype)
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[None, :] > pos[:, None] - window

    def whole_keys():
        k = k_cache.index_select(1, table).view(kv_heads, -1, d)[:, :n]
        v = v_cache.index_select(1, table).view(kv_heads, -1, d)[:, :n]
        return k, v

    ways = {}
    if heads * n * n * 4 <= EAGER_WHOLE_MAX_BYTES:

        def eager_whole():  # the grouped path's math for one row: the query heads of a KV head folded together
            k, v = whole_keys()
            q = query.view(kv_heads, heads // kv_heads * n, d)
            scores = torch.matmul(q, k.transpose(1, 2)) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.view(kv_heads, -1, n, n).masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(probs.view(kv_heads, -1, n), v)

        ways["eager-whole"] = eager_whole

    def tiles(kernel: str, tile: int):
        def run():
            rows = tiled.build_tiled(paged, np.array([0]), window, query.device, tile_queries=tile)
            for row in rows:  # tiles even where the shard runs a causal square as one call (that is `sdpa-row`)
                row.causal_square = False
            out = query.new_empty(n, heads, d)
            tiled.attend_tiled(query, k_cache, v_cache, rows, out, scaling, softcap, window, kernel)
            return out

        return run

    ways["eager-tiles"] = tiles("eager", 256)
    if softcap is None:  # SDPA and the half GEMMs cannot soft-cap
        ways["sdpa-tiles"] = tiles("sdpa", 256)
        if dtype in (torch.bfloat16, torch.float16):  # what the shard runs on CPU in half precision
            ways["half-tiles"] = tiles("half", 128)
        if dtype == torch.bfloat16 and d % 32 == 0 and _flash_ready():  # the shard's kernel on AMX: one call a row
            ways["flash"] = tiles("flash", 256)
        if sweep:  # the tile size
            ways["sdpa-tiles-128"], ways["sdpa-tiles-512"] = tiles("sdpa", 128), tiles("sdpa", 512)

        def sdpa_row():
            k, v = whole_keys()
            causal = dict(is_causal=True) if not window else dict(attn_mask=visible)
            return F.scaled_dot_product_attention(query[None], k[None], v[None], scale=scaling, enable_gqa=True,
                                                  **causal)  # fmt: skip

        ways["sdpa-row"] = sdpa_row
    compile_s = None
    if flex and softcap is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def seen(b, h, q_idx, kv_idx):
            if window:
                return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
            return kv_idx <= q_idx

        compiled = torch.compile(flex_attention, dynamic=False)
        t = clock.wall()
        block_mask = create_block_mask(seen, None, None, n, n, device="cpu")

        def flex_run():
            k, v = whole_keys()
            return compiled(query[None], k[None], v[None], block_mask=block_mask, scale=scaling, enable_gqa=True)

        flex_run()
        compile_s = clock.wall() - t
        ways["flex"] = flex_run
    return ways, compile_s


def _flash_ready() -> bool:
    """Whether the shard's flash kernel runs here (the C++ kernels built, oneDNN's bf16 brgemm: a CPU with AMX)."""
    from services.shard import cpu_kernels
    from services.shard.attention import tiled

    return cpu_kernels.load() and tiled.flash_ready()


def measure(
    ns,
    shapes: dict,
    dtypes,
    rounds: int,
    flex: bool,
    sweep_at=(2048,),
    progress=None,
    by=clock.wall,
    only: set[str] | None = None,
):
    """Per shape, layer kind (sliding, full), dtype and n: each candidate's median ms by the clock `by` (with
    `only`, those candidates alone: none of the others' memory traffic between their calls)."""
    import torch

    rows = []
    for name, shape in shapes.items():
        window = shape[3]
        for kind in ("sliding", "full") if window else ("full",):
            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                for n in ns:
                    w = window if kind == "sliding" else 0
                    ways, compile_s = candidates(n, shape, dtype, w, flex, sweep=n in sweep_at)
                    ways = {way: fn for way, fn in ways.items() if only is None or way in only}
                    times = {way: [] for way in ways}
                    with torch.inference_mode():
                        if n <= 2048:  # warm up (first-call allocations, kernel selection); long rows amortise it
                            for fn in ways.values():
                                fn()
                        for _ in range(rounds if n <= 2048 else 1):
                            for way, fn in ways.items():
                                times[way] += clock.times(fn, 1, clock=by)
                    med = {way: clock.p50_ms(v) for way, v in times.items()}
                    rows.append(dict(shape=name, layer=kind, dtype=dtype_name, n=n, ms=med, flex_compile_s=compile_s))
                    if progress is not None:
                        progress(rows[-1])
    return rows


def _engine(model_dir: str, n: int, dtype_name: str, chunk: int):
    """A ModelRunner with the KV blocks of one n-token prompt, and an engine feeding prompts `chunk` tokens a step."""
    import torch

    from bench.engine import Engine
    from services.scheduler.batcher import Batcher
    from services.shard.model_runner import ModelRunner

    blocks = -(-(n + 1) // 16) + 1
    runner = ModelRunner(model_dir, num_blocks=blocks, block_size=16, dtype=getattr(torch, dtype_name))
    batcher = Batcher(blocks, max_batch_size=1, max_batch_prefill_tokens=chunk, eos_ids=set(), prefix_caching=False,
                      block_size=16)  # fmt: skip
    return Engine(runner, batcher, wire=False)


def _prompt(engine, n: int):
    import numpy as np

    vocab = engine.runner.model.config.get_text_config().vocab_size
    return np.random.default_rng(0).integers(10, vocab, n)


def prefill(model_dir: str, n: int, dtype_name: str, rounds: int, by=clock.wall) -> float:
    """A real model's prefill of n random tokens in one step, on the shard's path: median ms over `rounds`."""
    from bench.engine import request

    engine = _engine(model_dir, n, dtype_name, n)
    ids = _prompt(engine, n)
    times = []
    for r in range(rounds + 1):  # the first round warms up
        engine.add(request(f"p{r}", ids, 1))
        t = by()
        engine.step()
        if r:
            times.append(by() - t)
    return clock.p50_ms(times)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def chunked(model_dir: str, n: int, chunk: int, dtype_name: str) -> tuple[list[float], float]:
    """A real model's prefill of n random tokens in chunks on the shard's path: each chunk's forward ms and the peak
    resident memory above the loaded model and its KV cache, in MiB, sampled every 5 ms while the chunks run."""
    import threading

    from bench.engine import request

    engine = _engine(model_dir, n, dtype_name, chunk)
    engine.add(request("long", _prompt(engine, n), 1))
    times: list[float] = []
    engine.on_step = lambda plan, result: times.append(result.forward_s * 1000)
    base, peak, done = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    engine.run()
    done.set()
    sampler.join()
    return times, max(peak[0], _rss_mib()) - base


NAMES = ["eager-whole", "eager-tiles", "sdpa-tiles", "sdpa-tiles-128", "sdpa-tiles-512", "sdpa-row", "half-tiles",
         "flash", "flex"]  # fmt: skip


def _line(r: dict) -> None:
    base = r["ms"].get("sdpa-tiles") or r["ms"].get("eager-tiles")  # none with --ways: the times alone
    ms = r["ms"]
    cells = [(f"{ms[x]:.1f}" + (f" ({ms[x] / base:.2f}x)" if base else "")) if x in ms else "—" for x in NAMES]
    print(f"| {r['shape']} | {r['layer']} | {r['dtype']} | {r['n']} | " + " | ".join(cells) + " |", flush=True)


def _header() -> None:
    print("| shape | layer | dtype | n | " + " | ".join(f"{x} ms" for x in NAMES) + " |")
    print("|---|---|---|---:|" + "---:|" * len(NAMES), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="512,2048,8192")
    ap.add_argument("--shape", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flex", action="store_true", help="also FlexAttention (compiles once per shape: minutes)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the shard's setting)")
    ap.add_argument("--cpu-time", action="store_true", help="time by the process's CPU seconds, not the wall clock "
                    "(steadier on a shared machine; with N threads it counts all of them)")  # fmt: skip
    ap.add_argument("--model", help="instead: a model's attention shape, and its whole prefill on the shard's path")
    ap.add_argument("--chunk", type=int, help="with --model: the prompt in chunks of this many tokens; peak RSS")
    ap.add_argument("--ways", help="only these candidates, comma-separated (e.g. `flash`, timed alone as "
                    "bench/kernels/vllm_attention.py times vLLM's)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    machine.shard_threads(args.threads or None)  # the shard's threads and heap, so that figures match the shard's
    by = clock.cpu if args.cpu_time else clock.wall
    ns, dtypes = [int(x) for x in args.n.split(",")], args.dtype.split(",")
    if args.model and args.chunk:
        print(machine.line(), flush=True)
        for dtype_name in dtypes:
            for n in ns:
                times, grown = chunked(args.model, n, args.chunk, dtype_name)
                per = ", ".join(f"{t:.0f}" for t in times)
                line = f"{dtype_name} n={n} in chunks of {args.chunk}: {per} ms"
                print(f"{line}; peak RSS +{grown:.0f} MiB over the loaded model", flush=True)
        return 0
    shapes = {os.path.basename(args.model.rstrip("/")): model_shape(args.model)} if args.model else {
        name: SHAPES[name] for name in args.shape.split(",")}  # fmt: skip
    if not args.json:
        print(machine.line() + (f"; {args.model}" if args.model else ""))
        _header()
    only = set(args.ways.split(",")) if args.ways else None
    rows = measure(ns, shapes, dtypes, args.rounds, args.flex, progress=None if args.json else _line, by=by, only=only)
    if args.model:
        if not args.json:
            print("\n| dtype | n | the model's prefill on the shard's path ms |\n|---|---:|---:|")
        for dtype_name in dtypes:
            for n in ns:
                ms = prefill(args.model, n, dtype_name, args.rounds, by=by)
                for r in rows:
                    if (r["dtype"], r["n"]) == (dtype_name, n):
                        r["prefill_ms"] = ms
                if not args.json:
                    print(f"| {dtype_name} | {n} | {ms:.0f} |", flush=True)
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        if r["flex_compile_s"] is not None:
            print(f"flex compile + first call, {r['shape']} {r['layer']} {r['dtype']} n={r['n']}: "
                  f"{r['flex_compile_s']:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
