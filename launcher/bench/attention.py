"""Prefill attention kernels against each other: one layer's attention for one prompt of n tokens on CPU.

Why the shard runs long prefill rows the way it does (services/shard/attention/tiled.py). Candidates, each reading
its keys from the paged cache as the shard does:
- `eager-whole`: the grouped path (one matmul over the whole [heads, n, n] score matrix, transformers' eager math)
- `eager-tiles`: the tiled path with the eager math per query tile (what soft-capped models run)
- `sdpa-tiles`: the tiled path with PyTorch's SDPA per tile (boolean mask, GQA in the kernel)
- `half-tiles` (bf16/fp16): the tiled path with two half-precision GEMMs per 128-query tile (the shard's CPU choice)
- `sdpa-row`: one SDPA call for the whole row (is_causal for full attention: what the shard runs for a full-attention
  row from position 0; an [n, n] mask for a window)
- `flex`: torch.compile'd FlexAttention over the whole row with a block mask (`--flex`: each shape compiles)
Candidates run interleaved, round after round, so that load on the machine hits them alike; the table gives each
one's median and its time relative to `sdpa-tiles`.

    python -m launcher.bench.attention [--n 512,2048,8192] [--dtype float32,bfloat16] [--flex] [--rounds 3]
    python -m launcher.bench.attention --model DIR --n 2048   # real prefill: tiled vs grouped, eager/SDPA/half tiles
    python -m launcher.bench.attention --model DIR --n 8192 --chunk 2048 --dtype float32   # chunks, peak RSS
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import time

# (name, heads, kv heads, head dim, sliding window of its local layers, scaling)
SHAPES = {
    "gemma3-270m": (4, 1, 256, 512, 256**-0.5),
    "llama-64": (9, 3, 64, 0, 64**-0.5),  # SmolLM2-135M-like: a small-body model, no sliding window
}
# the clock of every timing (--cpu-time: the process's CPU seconds)
CLOCK = time.perf_counter
EAGER_WHOLE_MAX_BYTES = 2**28  # fp32 scores; skip the whole score matrix beyond this (the reason the tiled path exists)


def cpu_flags() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("Model name")), "?")
    have = next((ln.split(":", 1)[1].split() for ln in flags.splitlines() if ln.startswith("Flags")), [])
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]
    return f"{model}; {' '.join(wanted) or 'no AVX-512'}"


def _case(n: int, shape: str, dtype, window: int, block_size: int = 16):
    """A one-row prefill of n tokens (context 0) over a random paged cache, as the shard's attention sees it."""
    import numpy as np
    import torch

    from services.shard.attention.paged import PagedBatch

    heads, kv_heads, d, _, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    blocks = -(-n // block_size)
    k_cache = torch.randn(kv_heads, blocks, block_size, d, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, block_size, d, generator=gen).to(dtype)
    query = torch.randn(heads, n, d, generator=gen).to(dtype)
    table = np.random.default_rng(0).permutation(blocks)[None].astype(np.int64)

    def batch():
        return PagedBatch(
            kv_cache=[(k_cache, v_cache)],
            slot_mapping=None,
            cu_seqlens_q=None,
            context_lens=None,
            block_tables=None,
            block_size=block_size,
            host_cu=np.array([0, n]),
            host_context=np.array([0]),
            host_tables=table,
        )

    return query, k_cache, v_cache, torch.from_numpy(table[0]), batch


def candidates(n: int, shape: str, dtype, window: int, flex: bool, sweep: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from services.shard.attention import paged, tiled

    heads, kv_heads, d, _, scaling = SHAPES[shape]
    query, k_cache, v_cache, table, batch = _case(n, shape, dtype, window)
    ways = {}
    if heads * n * n * 4 <= EAGER_WHOLE_MAX_BYTES:

        def eager_whole():
            tiled.TILE_MIN_QUERIES = n + 1
            groups, _ = batch().plan(window, query.device)
            # the grouped path takes [T, heads, D] since the lean forward (its first parameter: `tokens`)
            token_major = next(iter(inspect.signature(paged.attend).parameters)) == "tokens"
            q = query.transpose(0, 1) if token_major else query
            return paged.attend(q, k_cache, v_cache, groups, scaling, None)

        ways["eager-whole"] = eager_whole

    def tiles(kernel: str, tile: int):
        def run():
            tiled.TILE_MIN_QUERIES, tiled.TILE_QUERIES = 2, tile
            _, rows = batch().plan(window, query.device)
            for row in rows:  # tiles even where the shard runs a causal square as one call (that is `sdpa-row`)
                row.causal_square = False
            out = query.new_empty(n, heads, d)
            tiled.attend_tiled(query, k_cache, v_cache, rows, out, scaling, None, window, kernel)
            return out

        return run

    ways["eager-tiles"] = tiles("eager", 256)
    ways["sdpa-tiles"] = tiles("sdpa", 256)
    if dtype in (torch.bfloat16, torch.float16):  # what the shard runs on CPU in half precision
        ways["half-tiles"] = tiles("half", 128)
    if sweep:  # the tile size
        ways["sdpa-tiles-128"], ways["sdpa-tiles-512"] = tiles("sdpa", 128), tiles("sdpa", 512)

    def whole_keys():
        k = k_cache.index_select(1, table).view(kv_heads, -1, d)[:, :n]
        v = v_cache.index_select(1, table).view(kv_heads, -1, d)[:, :n]
        return k[None], v[None]

    pos = torch.arange(n)
    row_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window) if window else None

    def sdpa_row():
        k, v = whole_keys()
        causal = dict(is_causal=True) if row_mask is None else dict(attn_mask=row_mask)
        return F.scaled_dot_product_attention(query[None], k, v, scale=scaling, enable_gqa=True, **causal)

    ways["sdpa-row"] = sdpa_row
    compile_s = None
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def visible(b, h, q_idx, kv_idx):
            if window:
                return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
            return kv_idx <= q_idx

        compiled = torch.compile(flex_attention, dynamic=False)
        t = time.perf_counter()
        block_mask = create_block_mask(visible, None, None, n, n, device="cpu")

        def flex_run():
            k, v = whole_keys()
            return compiled(query[None], k, v, block_mask=block_mask, scale=scaling, enable_gqa=True)

        flex_run()
        compile_s = time.perf_counter() - t
        ways["flex"] = flex_run
    return ways, compile_s


def measure(ns, shapes, dtypes, rounds: int, flex: bool, sweep_at=(2048,), progress=None) -> list[dict]:
    import torch

    from services.shard.attention import tiled

    saved = tiled.TILE_MIN_QUERIES, tiled.TILE_QUERIES
    rows = []
    try:
        for shape in shapes:
            window = SHAPES[shape][3]
            for kind in ("sliding", "full") if window else ("full",):
                for dtype_name in dtypes:
                    dtype = getattr(torch, dtype_name)
                    for n in ns:
                        w = window if kind == "sliding" else 0
                        ways, compile_s = candidates(n, shape, dtype, w, flex, sweep=n in sweep_at)
                        times = {name: [] for name in ways}
                        with torch.inference_mode():
                            if n <= 2048:  # warm up (first-call allocations, kernel selection); long rows amortise it
                                for fn in ways.values():
                                    fn()
                            for _ in range(rounds if n <= 2048 else 1):
                                for name, fn in ways.items():
                                    t = CLOCK()
                                    fn()
                                    times[name].append(CLOCK() - t)
                        med = {name: statistics.median(v) * 1000 for name, v in times.items()}
                        rows.append(
                            dict(shape=shape, layer=kind, dtype=dtype_name, n=n, ms=med, flex_compile_s=compile_s)
                        )
                        if progress is not None:
                            progress(rows[-1])
    finally:
        tiled.TILE_MIN_QUERIES, tiled.TILE_QUERIES = saved
    return rows


def prefill(model_dir: str, n: int, dtype_name: str, rounds: int) -> dict[str, float]:
    """A real model's prefill forward of n random tokens (one step, context 0) in ms: the tiled path against the
    grouped path for every row (`TILE_MIN_QUERIES` past n) and the tiled path with eager tiles and with SDPA tiles
    (what the bf16 rule in tiled.choose_kernel picks between; SDPA only where no layer soft-caps),
    interleaved."""
    import numpy as np
    import torch

    from libs.protocol.params import SamplingParams
    from libs.protocol.step_messages import NewSequence, StepPlan
    from services.shard.attention import tiled
    from services.shard.model_runner import ModelRunner

    blocks = -(-n // 16)
    runner = ModelRunner(model_dir, num_blocks=blocks, block_size=16, dtype=getattr(torch, dtype_name))
    vocab = runner.model.config.get_text_config().vocab_size
    ids = np.random.default_rng(0).integers(10, vocab, n).astype(np.int32)
    step = 0

    def once() -> float:
        nonlocal step
        step += 2
        plan = StepPlan(
            step=step,
            new=[NewSequence(0, SamplingParams())],
            blocks={0: list(range(blocks))},
            seqs=np.array([0], np.int32),
            num_tokens=np.array([n], np.int32),
            context_lens=np.array([0], np.int32),
            token_ids=ids,
            sample=np.array([1], np.uint8),
        )
        t = CLOCK()
        runner.execute(plan)
        took = CLOCK() - t
        empty = np.zeros(0, np.int32)
        rows = dict(seqs=empty, num_tokens=empty, context_lens=empty, token_ids=empty, sample=empty.astype(np.uint8))
        runner.execute(StepPlan(step=step + 1, finished=[0], **rows))
        return took

    saved = tiled.TILE_MIN_QUERIES
    softcaps = getattr(runner.model.config.get_text_config(), "attn_logit_softcapping", None)
    half = dtype_name in ("bfloat16", "float16")
    times = {"grouped": [], "tiled": [], "tiled-eager": [], **({} if softcaps else {"tiled-sdpa": []}),
             **({"tiled-half": []} if half and not softcaps else {})}  # fmt: skip
    try:
        for r in range(rounds + 1):  # the first round warms up
            for name in times:
                tiled.TILE_MIN_QUERIES = n + 1 if name == "grouped" else saved
                tiled.KERNEL = {"tiled-eager": "eager", "tiled-sdpa": "sdpa", "tiled-half": "half"}.get(name)
                took = once()
                if r:
                    times[name].append(took)
    finally:
        tiled.TILE_MIN_QUERIES, tiled.KERNEL = saved, None
    return {name: statistics.median(v) * 1000 for name, v in times.items()}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def chunked(model_dir: str, n: int, chunk: int, dtype_name: str, tiled: bool = True) -> tuple[list[float], float]:
    """A real model's prefill of n random tokens in chunks (tiled: the shard's default path; else the grouped path
    for every row): each chunk's forward ms and the peak resident memory above the loaded model and its KV cache,
    in MiB, sampled every 5 ms while the chunks run."""
    import threading

    import numpy as np
    import torch

    from libs.protocol.params import SamplingParams
    from libs.protocol.step_messages import NewSequence, StepPlan
    from services.shard.model_runner import ModelRunner

    blocks = -(-n // 16)
    runner = ModelRunner(model_dir, num_blocks=blocks, block_size=16, dtype=getattr(torch, dtype_name))
    vocab = runner.model.config.get_text_config().vocab_size
    ids = np.random.default_rng(0).integers(10, vocab, n).astype(np.int32)
    from services.shard.attention import tiled

    tiled.TILE_MIN_QUERIES = tiled.TILE_MIN_QUERIES if tiled else n + 1
    base, peak, done = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times = []
    for step, start in enumerate(range(0, n, chunk)):
        m = min(chunk, n - start)
        plan = StepPlan(
            step=step + 1,
            new=[NewSequence(0, SamplingParams())] if start == 0 else [],
            blocks={0: list(range(blocks))} if start == 0 else {},
            seqs=np.array([0], np.int32),
            num_tokens=np.array([m], np.int32),
            context_lens=np.array([start], np.int32),
            token_ids=ids[start : start + m],
            sample=np.array([start + m == n], np.uint8),
        )
        times.append(runner.execute(plan).forward_s * 1000)
    done.set()
    sampler.join()
    return times, max(peak[0], _rss_mib()) - base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="512,2048,8192")
    ap.add_argument("--shape", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flex", action="store_true", help="also FlexAttention (compiles once per shape: minutes)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as the shard)")
    ap.add_argument("--cpu-time", action="store_true", help="time by the process's CPU seconds, not the wall clock "
                    "(steadier on a shared machine; with N threads it counts all of them)")  # fmt: skip
    ap.add_argument("--model", help="instead: a real model's prefill forward of each --n tokens, tiled vs grouped")
    ap.add_argument("--chunk", type=int, help="with --model: only the default path, the prompt in chunks; peak RSS")
    ap.add_argument("--grouped", action="store_true", help="with --chunk: the grouped path for every row")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK = time.process_time
    if args.model and args.chunk:
        for dtype_name in args.dtype.split(","):
            for n in (int(x) for x in args.n.split(",")):
                times, grown = chunked(args.model, n, args.chunk, dtype_name, tiled=not args.grouped)
                per = ", ".join(f"{t:.0f}" for t in times)
                path = "grouped" if args.grouped else "default"
                line = f"{dtype_name} n={n} in chunks of {args.chunk} ({path} path): {per} ms"
                print(f"{line}; peak RSS +{grown:.0f} MiB over the loaded model", flush=True)
        return 0
    if args.model:
        print(f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model}")
        print("| dtype | n | grouped ms | tiled ms | tiled, eager tiles ms | tiled, SDPA tiles ms "
              "| tiled, half tiles ms | speed-up (tiled) |", flush=True)  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        for dtype_name in args.dtype.split(","):
            for n in (int(x) for x in args.n.split(",")):
                ms = prefill(args.model, n, dtype_name, args.rounds)
                speed = ms["grouped"] / ms["tiled"]
                kinds = ("grouped", "tiled", "tiled-eager", "tiled-sdpa", "tiled-half")
                cells = " | ".join(f"{ms[x]:.0f}" if x in ms else "–" for x in kinds)
                print(f"| {dtype_name} | {n} | {cells} | {speed:.2f}x |", flush=True)
        return 0
    ns = [int(x) for x in args.n.split(",")]
    names = [
        "eager-whole",
        "eager-tiles",
        "sdpa-tiles",
        "sdpa-tiles-128",
        "sdpa-tiles-512",
        "sdpa-row",
        "half-tiles",
        "flex",
    ]

    def line(r: dict) -> None:
        base = r["ms"]["sdpa-tiles"]
        cells = [f"{r['ms'][x]:.1f} ({r['ms'][x] / base:.2f}x)" if x in r["ms"] else "—" for x in names]
        print(f"| {r['shape']} | {r['layer']} | {r['dtype']} | {r['n']} | " + " | ".join(cells) + " |", flush=True)

    if not args.json:
        print(f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
        print("| shape | layer | dtype | n | " + " | ".join(f"{x} ms" for x in names) + " |")
        print("|---|---|---|---:|" + "---:|" * len(names), flush=True)
    rows = measure(
        ns, args.shape.split(","), args.dtype.split(","), args.rounds, args.flex, progress=None if args.json else line
    )
    if args.json:
        print(json.dumps(rows))
        return 0
    compiles = [r for r in rows if r["flex_compile_s"] is not None]
    for r in compiles:
        print(
            f"flex compile + first call, {r['shape']} {r['layer']} {r['dtype']} n={r['n']}: {r['flex_compile_s']:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
