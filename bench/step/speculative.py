"""The speculative workload's in-process half: the model driven through the in-process engine (bench/engine.py: the
real Batcher and ModelRunner, no bus, no HTTP), so the ratios are speculation's own.

- `steps`: decode steps at `--batch` rows, plain and with drafts (k rows × d random drafts each, `--configs`:
  verifying costs the same whether they are right), interleaved step by step, in CPU seconds of the process (one
  torch thread) and wall seconds: what a drafted position costs, which services/scheduler/drafting.py weighs;
- `loop`: a closed loop over the speculative bench's prompts (copy or free writing, `--concurrency` at a time),
  `--speculate 0` against N, interleaved over `--rounds`: the scheduler's Python is in it, the pipeline's not.

    python -m bench.step.speculative steps --batch 16
    python -m bench.step.speculative loop --workload free --concurrency 16 --waves 2
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench import clock, machine
from bench.workloads import speculative as spec_bench

BLOCK = 16


def _runner(model_dir: str, num_blocks: int, dtype: str):
    import torch

    from services.shard.model_runner import ModelRunner

    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=BLOCK, dtype=getattr(torch, dtype))


def _engine(runner, **batcher_kwargs):
    """An engine over `runner` with a fresh Batcher of its KV blocks (the runner forgets every sequence first, as
    for a new scheduler)."""
    from bench.engine import Engine
    from services.scheduler.batcher import Batcher

    runner.reset()
    return Engine(runner, Batcher(runner.num_blocks, block_size=runner.block_size, **batcher_kwargs), wire=False)


class RandomDrafts:
    """A drafter for the Batcher that proposes `each` random tokens for each of the first `rows` decode rows of a
    step (the configuration under test), whatever the rows hold."""

    def __init__(self, vocab: int, rng) -> None:
        self.vocab, self.rng = vocab, rng
        self.rows = self.each = 0

    def propose(self, rows: list) -> dict[int, list[int]]:
        return {i: self.rng.integers(3, self.vocab, self.each).tolist() for i in range(min(self.rows, len(rows)))}

    def planned(self, step: int, rows: list, proposed: dict, kept: dict) -> None:
        pass

    def timed(self, step: int, forward_s: float) -> None:
        pass


def steps(model_dir: str, batch: int, configs: list[tuple[int, int]], rounds: int, dtype: str) -> dict:
    """Median CPU ms of a decode step per (rows drafted, drafts each), the first config plain (0, 0)."""
    from bench.engine import request

    prompt, most = 64, max(d for _, d in configs)
    max_new = (rounds + 1) * (most + 1) * len(configs) + 8  # no row ends before the last step
    num_blocks = batch * -(-(prompt + max_new + most + 1) // BLOCK) + 8
    engine = _engine(_runner(model_dir, num_blocks, dtype), max_batch_size=batch, max_batch_prefill_tokens=4096,
                     eos_ids=set(), prefix_caching=False, speculate=max(most, 1))  # fmt: skip
    vocab = engine.runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    drafter = engine.batcher.drafter = RandomDrafts(vocab, rng)
    for i in range(batch):
        engine.add(request(f"r{i}", rng.integers(3, vocab, prompt), max_new))
    engine.step()  # every prompt in one step

    def step(rows_drafted: int, each: int) -> tuple[float, float]:
        drafter.rows, drafter.each = rows_drafted, each
        with clock.Lap() as lap:
            engine.step()
        return lap.cpu, lap.wall

    for c in configs:  # warm-up: first-use allocations and kernels
        step(*c)
    times: dict = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            times[c].append(step(*c))
    base = clock.p50_ms(t[0] for t in times[configs[0]])
    rows = []
    for (k, d), t in times.items():
        cpu = clock.p50_ms(x[0] for x in t)
        rows.append({"rows_drafted": k, "drafts_each": d, "positions": batch + k * d, "cpu_ms": cpu,
                     "wall_ms": clock.p50_ms(x[1] for x in t), "vs_plain": cpu / base})  # fmt: skip
    return {"model_dir": model_dir, "batch": batch, "dtype": dtype, "rounds": rounds, "steps": rows}


def loop(model_dir: str, workload: str, concurrency: int, waves: int, max_new: int, n: int, rounds: int, dtype: str):
    """The closed loop, `--speculate 0` and N interleaved: CPU and wall seconds, steps, drafted and accepted."""
    from transformers import AutoTokenizer

    from bench.engine import request
    from libs.runtime import model_store

    tok = AutoTokenizer.from_pretrained(model_dir)
    jobs = spec_bench.prompts(model_dir, workload, concurrency * waves, max_new)
    ids = [np.asarray(tok(j.prompt, add_special_tokens=False).input_ids, np.int32) for j in jobs]
    eos = set(model_store.model_info(model_dir)["eos_token_ids"])
    num_blocks = concurrency * -(-(max(len(i) for i in ids) + max_new + n + 2) // BLOCK) + 16
    runner = _runner(model_dir, num_blocks, dtype)

    def run(speculate: int) -> dict:
        e = _engine(runner, max_batch_size=max(concurrency, 1), max_batch_prefill_tokens=4096, eos_ids=eos,
                    speculate=speculate, max_prefill_tokens_while_decoding=512)  # fmt: skip
        todo, running = list(range(len(ids))), 0
        with clock.Lap() as lap:
            while todo or e.batcher.has_work():
                while todo and running < concurrency:
                    i = todo.pop(0)
                    e.add(request(str(i), ids[i], max_new))
                    running += 1
                for row in e.step() or []:
                    running -= bool(row.finish)
        c = e.batcher.counters
        return {"speculate": speculate, "cpu_s": lap.cpu, "wall_s": lap.wall, "steps": e.steps,
                "generated": c["generated"], "drafted": c["draft_tokens"], "accepted": c["accepted_tokens"],
                "out": {int(rid): o.tokens for rid, o in e.outputs.items()}}  # fmt: skip

    run(0)  # warm-up
    runs: dict[int, list] = {0: [], n: []}
    for r in range(rounds):  # alternated, so a change of machine load hits both sides
        for s in (0, n) if r % 2 == 0 else (n, 0):
            runs[s].append(run(s))
    plain, spec = runs[0], runs[n]
    same = sum(plain[0]["out"][i] == spec[0]["out"][i] for i in plain[0]["out"])
    for x in plain + spec:
        del x["out"]
    ratio = {k: clock.p50_ms(x[k] for x in plain) / clock.p50_ms(x[k] for x in spec) for k in ("cpu_s", "wall_s")}
    return {"model_dir": model_dir, "workload": workload, "concurrency": concurrency, "waves": waves,
            "max_new": max_new, "speculate": n, "dtype": dtype, "speedup_cpu": ratio["cpu_s"],
            "speedup_wall": ratio["wall_s"], "same_outputs": f"{same}/{len(ids)}", "runs": plain + spec}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["steps", "loop"])
    ap.add_argument("--model", default="", help="a model folder (default: the default model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=8, help="steps: steps per config; loop: runs per side")
    ap.add_argument("--batch", type=int, default=16, help="steps: decode rows")
    ap.add_argument("--configs", default="0x0,1x1,16x1,4x4,16x2,16x4", help="steps: rows drafted x drafts each")
    ap.add_argument("--workload", default="free", choices=["free", "copy"], help="loop: the prompts")
    ap.add_argument("--concurrency", type=int, default=16, help="loop: requests at a time")
    ap.add_argument("--waves", type=int, default=2, help="loop: requests = waves × concurrency")
    ap.add_argument("--max-new", type=int, default=160, help="loop: max_new_tokens")
    ap.add_argument("--speculate", type=int, default=4, help="loop: the N compared with 0")
    args = ap.parse_args(argv)
    from libs.runtime import model_store

    machine.shard_threads(1)  # one thread unless asked: CPU time is its time
    model_dir = str(model_store.resolve_model(args.model or None))
    if args.mode == "steps":
        configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
        if configs[0] != (0, 0):
            configs.insert(0, (0, 0))
        out = steps(model_dir, args.batch, configs, max(args.rounds, 1), args.dtype)
        for r in out["steps"]:
            print(f"{r['rows_drafted']:3d} rows x {r['drafts_each']} drafts: {r['positions']:4d} positions "
                  f"{r['cpu_ms']:8.1f} ms CPU ({r['vs_plain']:.2f}x plain)  wall {r['wall_ms']:8.1f} ms",
                  file=sys.stderr)  # fmt: skip
    else:
        out = loop(model_dir, args.workload, args.concurrency, args.waves, args.max_new, args.speculate,
                   max(args.rounds, 1), args.dtype)  # fmt: skip
        for r in out["runs"]:
            print(f"--speculate {r['speculate']}: {r['cpu_s']:7.1f} s CPU {r['wall_s']:7.1f} s wall "
                  f"{r['steps']:5d} steps {r['generated']} tokens, drafted {r['drafted']} accepted {r['accepted']}",
                  file=sys.stderr)  # fmt: skip
        print(f"{args.workload} at {args.concurrency}: speedup {out['speedup_cpu']:.2f}x CPU, "
              f"{out['speedup_wall']:.2f}x wall; same outputs {out['same_outputs']}", file=sys.stderr)  # fmt: skip
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
