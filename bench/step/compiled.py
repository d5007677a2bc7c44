"""The compiled decode step against the eager walk, in process (bench/engine.py), on one model.

Three parts, each printed as JSON lines and summed up in a table:
- start-up: a fresh process builds the runner (load, pack, and for the compiled runner the compile at start), with
  inductor's cache empty, then again with it warm (the second start of a server); the graphs dynamo traced (one per
  kind of layer) and the cache's hits and misses;
- decode steps of 1/16/64 rows (prompts of 32 tokens), eager and compiled interleaved round by round on the same
  machine load, the ratio per round (eager / compiled step time) and its median;
- a 2k-token prompt's prefill (TTFT in process), interleaved the same way.

    python -m bench.step.compiled --model smollm2 --rows 1,16,64 --rounds 5
    python -m bench.step.compiled --model gemma --dtype bfloat16

Threads as the shard sets them (SWITCHYARD_TORCH_THREADS, else every core). In float32 (the exact mode, which the
server keeps eager) the bench compiles it anyway, to measure what compiling would give there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from bench import clock, machine

PROMPT = 32
LONG_PROMPT = 2048
NUM_BLOCKS = 640  # 64 rows of prompt and steps, and a 2k prompt, in blocks of 16


def build(model_dir: str, dtype: str, compile: bool):
    import torch

    from services.shard.model_runner import ModelRunner

    return ModelRunner(model_dir, num_blocks=NUM_BLOCKS, dtype=getattr(torch, dtype), compile=compile)


def start(model_dir: str, dtype: str, compile: bool, cache: str) -> dict:
    """One start in this process: the runner built (with the compile at start when asked), inductor's cache under
    `cache`."""
    from torch._dynamo.utils import counters

    from services.shard.model.compiled import use_cache_dir

    use_cache_dir(cache)
    with clock.Lap() as lap:
        runner = build(model_dir, dtype, compile)
    compiled = runner.compiled
    return {
        "compile": compile,
        "start_s": round(lap.wall, 2),
        "start_cpu_s": round(lap.cpu, 2),
        "compile_s": round(compiled.compile_s, 2) if compiled else 0.0,
        "graphs": compiled.graphs if compiled else 0,  # one per kind of layer (regional compile)
        "reason": runner.compiled_reason,
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }


def _start_in_child(model_dir: str, dtype: str, compile: bool, cache: str) -> dict:
    argv = [sys.executable, "-m", "bench.step.compiled", "--model", model_dir, "--dtype", dtype, "--start-only",
            "--cache", cache] + ([] if compile else ["--no-compile"])  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def decode_ms(runner, model_dir: str, rows: int, steps: int, rng) -> float:
    """Median wall ms of `steps` decode steps of `rows` rows (their prompts prefilled first, untimed)."""
    from bench.engine import Engine, request

    engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=4096, eos_ids=set(), wire=False)
    vocab = runner.model.config.get_text_config().vocab_size
    for i in range(rows):
        engine.add(request(f"r{i}", rng.integers(3, vocab, PROMPT), steps + 1))
    engine.step()  # every prompt in one step, each row's first token
    laps = []
    while engine.batcher.has_work():
        with clock.Lap() as lap:
            engine.step()
        laps.append(lap.wall)
    return clock.p50_ms(laps)


def prefill_ms(runner, model_dir: str, rng) -> float:
    """Wall ms of one 2k-token prompt's prefill step (its first token)."""
    from bench.engine import Engine, request

    engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=4096, eos_ids=set(), wire=False)
    engine.add(request("long", rng.integers(3, runner.model.config.get_text_config().vocab_size, LONG_PROMPT), 1))
    with clock.Lap() as lap:
        engine.step()
    return lap.wall * 1000


def interleaved(model_dir: str, dtype: str, rows: list[int], rounds: int, steps: int, cache: str) -> dict:
    """Eager and compiled runners side by side; each round measures both, in alternating order."""
    from services.shard.model.compiled import use_cache_dir

    use_cache_dir(cache)
    runners = {"eager": build(model_dir, dtype, False), "compiled": build(model_dir, dtype, True)}
    rng = np.random.default_rng(0)
    for runner in runners.values():  # first-call allocations
        decode_ms(runner, model_dir, 2, 2, rng)
    out = {}
    for shape in [*rows, "prefill_2k"]:
        got = {"eager": [], "compiled": []}
        for r in range(rounds):
            order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
            for mode in order:
                runner = runners[mode]
                ms = prefill_ms(runner, model_dir, rng) if shape == "prefill_2k" else decode_ms(
                    runner, model_dir, shape, steps, rng
                )  # fmt: skip
                got[mode].append(ms)
        ratios = [e / c for e, c in zip(got["eager"], got["compiled"])]
        out[str(shape)] = {
            "eager_ms": round(statistics.median(got["eager"]), 2),
            "compiled_ms": round(statistics.median(got["compiled"]), 2),
            "speedup": round(statistics.median(ratios), 3),  # eager / compiled, per round, the median
            "ratios": [round(x, 3) for x in ratios],
        }
        print(json.dumps({str(shape): out[str(shape)]}), file=sys.stderr, flush=True)
    out["counts"] = dict(runners["compiled"].compiled.counts)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="smollm2, gemma (embedded), or a local folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    ap.add_argument("--cache", default="", help="inductor's cache folder (default: a fresh one, empty at first)")
    ap.add_argument("--start-only", action="store_true", help="one start in this process (the child's part)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args(argv)
    machine.shard_threads()
    from services.shard.model import compiled

    compiled.EAGER_DTYPES = ()  # measure every dtype, the exact mode's included
    if args.start_only:
        print(json.dumps(start(args.model, args.dtype, not args.no_compile, args.cache)))
        return 0
    model_dir = resolve(args.model)
    cache = args.cache or tempfile.mkdtemp(prefix="switchyard-inductor-")
    starts = {
        "eager": _start_in_child(model_dir, args.dtype, False, cache),
        "compiled_empty_cache": _start_in_child(model_dir, args.dtype, True, cache),
        "compiled_warm_cache": _start_in_child(model_dir, args.dtype, True, cache),
    }
    print(json.dumps({"start": starts}), file=sys.stderr, flush=True)
    rows = [int(r) for r in args.rows.split(",") if r]
    steps = interleaved(model_dir, args.dtype, rows, args.rounds, args.steps, cache)
    result = {"model": args.model, "dtype": args.dtype, "machine": machine.line(), "load": machine.load(),
              "start": starts, "steps": steps}  # fmt: skip
    print(json.dumps(result))
    print(table(result), file=sys.stderr)
    return 0


def resolve(model: str) -> str:
    """The folder of `smollm2` or `gemma` (the embedded models, prepared by `make model model-gemma`) or a folder."""
    from libs.runtime import model_store

    names = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m"}
    return str(model_store.resolve_model(names.get(model, model)))


def table(result: dict) -> str:
    s, st = result["start"], result["steps"]
    lines = [
        f"{result['model']} ({result['dtype']}), {result['machine']}",
        f"start: eager {s['eager']['start_s']} s; compiled, empty cache {s['compiled_empty_cache']['start_s']} s "
        f"(compile {s['compiled_empty_cache']['compile_s']} s, {s['compiled_empty_cache']['graphs']} graphs); "
        f"warm cache {s['compiled_warm_cache']['start_s']} s "
        f"(compile {s['compiled_warm_cache']['compile_s']} s, {s['compiled_warm_cache']['fxgraph_cache_hit']} hits)",
        "| rows | eager step ms | compiled step ms | eager tok/s | compiled tok/s | speedup (median of rounds) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, v in st.items():
        if key in ("counts", "prefill_2k"):
            continue
        rows = int(key)
        lines.append(f"| {rows} | {v['eager_ms']} | {v['compiled_ms']} | {1000 * rows / v['eager_ms']:.0f} | "
                     f"{1000 * rows / v['compiled_ms']:.0f} | {v['speedup']}× |")  # fmt: skip
    p = st["prefill_2k"]
    lines.append(f"| 2k prefill (TTFT ms) | {p['eager_ms']} | {p['compiled_ms']} | | | {p['speedup']}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
