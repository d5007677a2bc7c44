"""The speculative workload's in-process half: no bus, no HTTP, so the ratios are speculation's own.

- `steps`: the shard's ModelRunner decode step at `--batch` rows, plain and with drafts (k rows × d drafts each,
  random drafts: verification costs the same whether they are right), in CPU seconds of the calling thread, the
  configurations interleaved. What a drafted position costs against the plain step is what the drafter's rule in
  services/scheduler/drafting.py must weigh; and whether a drafted step costs more than its positions.
- `loop`: the real Batcher and ModelRunner in a closed loop over the speculative bench's prompts (copy or free
  writing, `--concurrency` at a time), `--speculate 0` against N, the two interleaved over `--rounds`; the
  scheduler's Python (plan, apply) is in it, the pipeline's processes are not.

CPU seconds of the process (one torch thread) are steadier than wall time on a busy machine (wall time is reported too).

    python -m launcher.bench.speculative_step steps --batch 16
    python -m launcher.bench.speculative_step loop --workload free --concurrency 16 --waves 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from launcher.bench import speculative as spec_bench

BLOCK = 16


def _runner(model_dir: str, num_blocks: int, dtype: str):
    import torch

    from services.shard.model_runner import ModelRunner

    return ModelRunner(model_dir, num_blocks=num_blocks, dtype=getattr(torch, dtype))


def steps(model_dir: str, batch: int, configs: list[tuple[int, int]], rounds: int, dtype: str) -> dict:
    """Median CPU ms of a decode step per (rows drafted, drafts each), the first config plain (0, 0)."""
    from libs.protocol.params import SamplingParams
    from libs.protocol.step_messages import NewSequence, StepPlan

    prompt, per_seq = 64, -(-(64 + (rounds + 1) * (max(d for _, d in configs) + 1) * len(configs) + 8) // BLOCK)
    runner = _runner(model_dir, batch * per_seq, dtype)
    vocab = runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    seqs = list(range(batch))
    ctx = dict.fromkeys(seqs, prompt)
    number = 0

    def execute(rows, drafts=None, new=(), blocks=None):
        nonlocal number
        number += 1
        seq, fed = zip(*rows)
        plan = StepPlan(step=number, new=list(new), blocks=blocks or {}, finished=[], seqs=np.asarray(seq, np.int32),
                        num_tokens=np.asarray([len(f) for f in fed], np.int32),
                        context_lens=np.asarray([ctx[s] if not new else 0 for s in seq], np.int32),
                        token_ids=np.concatenate(fed).astype(np.int32), sample=np.ones(len(rows), np.uint8),
                        drafts=np.asarray(drafts if drafts is not None else [], np.int32))  # fmt: skip
        t0, c0 = time.perf_counter(), time.process_time()
        res = runner.execute(plan)
        return res, time.process_time() - c0, time.perf_counter() - t0

    new = [NewSequence(s, SamplingParams()) for s in seqs]
    blocks = {s: list(range(s * per_seq, (s + 1) * per_seq)) for s in seqs}
    res, _, _ = execute([(s, rng.integers(3, vocab, prompt)) for s in seqs], new=new, blocks=blocks)
    last = dict(zip(res.seqs.tolist(), res.token_ids.tolist()))

    def step(rows_drafted: int, each: int) -> tuple[float, float]:
        drafts = [each if i < rows_drafted else 0 for i in range(batch)]
        rows = [(s, np.concatenate([[last[s]], rng.integers(3, vocab, d)])) for s, d in zip(seqs, drafts)]
        res, cpu, wall = execute(rows, drafts if rows_drafted else None)
        at = 0
        for s, n in zip(res.seqs.tolist(), res.token_counts.tolist() or [1] * batch):
            last[s], at = int(res.token_ids[at + n - 1]), at + n
            ctx[s] += n
        return cpu, wall

    for c in configs:  # warm-up: first-use allocations and kernels
        step(*c)
    times: dict = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            times[c].append(step(*c))
    base = statistics.median(t[0] for t in times[configs[0]])
    rows = []
    for (k, d), t in times.items():
        cpu = statistics.median(x[0] for x in t)
        rows.append({"rows_drafted": k, "drafts_each": d, "positions": batch + k * d, "cpu_ms": cpu * 1000,
                     "wall_ms": statistics.median(x[1] for x in t) * 1000, "vs_plain": cpu / base})  # fmt: skip
    return {"model_dir": model_dir, "batch": batch, "dtype": dtype, "rounds": rounds, "steps": rows}


def loop(model_dir: str, workload: str, concurrency: int, waves: int, max_new: int, n: int, rounds: int, dtype: str):
    """The closed loop, `--speculate 0` and N interleaved: CPU and wall seconds, steps, drafted and accepted."""
    from transformers import AutoTokenizer

    from libs.protocol.messages import TokenizedRequest
    from libs.protocol.params import SamplingParams
    from libs.runtime import model_store
    from services.scheduler.batcher import Batcher

    tok = AutoTokenizer.from_pretrained(model_dir)
    jobs = spec_bench.prompts(model_dir, workload, concurrency * waves, max_new)
    ids = [np.asarray(tok(j.prompt, add_special_tokens=False).input_ids, np.int32) for j in jobs]
    eos = set(model_store.model_info(model_dir)["eos_token_ids"])
    num_blocks = concurrency * -(-(max(len(i) for i in ids) + max_new + n + 2) // BLOCK) + 16
    runner = _runner(model_dir, num_blocks, dtype)

    def run(speculate: int) -> dict:
        b = Batcher(num_blocks, max_batch_size=max(concurrency, 1), max_batch_prefill_tokens=4096, eos_ids=eos,
                    speculate=speculate, max_prefill_tokens_while_decoding=512)  # fmt: skip
        todo, out, running, step = list(range(len(ids))), {}, 0, 0
        t0, c0 = time.perf_counter(), time.process_time()
        while todo or b.has_work():
            while todo and running < concurrency:
                i = todo.pop(0)
                out[i], running = [], running + 1
                b.add(TokenizedRequest(request_id=str(i), ingress=0, input_ids=ids[i], sampling=SamplingParams(),
                                       max_new_tokens=max_new))  # fmt: skip
            step += 1
            plan = b.plan(step)
            if plan is None:
                continue
            for row in b.apply(runner.execute(plan)):
                out[int(row.seq.req.request_id)].append(row.token_id)
                running -= bool(row.finish)
        c = b.counters
        return {"speculate": speculate, "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
                "steps": step, "generated": c["generated"], "drafted": c["draft_tokens"],
                "accepted": c["accepted_tokens"], "out": out}  # fmt: skip

    run(0)  # warm-up
    runs: dict[int, list] = {0: [], n: []}
    for r in range(rounds):  # alternated, so a change of machine load hits both sides
        for s in (0, n) if r % 2 == 0 else (n, 0):
            runs[s].append(run(s))
    plain, spec = runs[0], runs[n]
    same = sum(plain[0]["out"][i] == spec[0]["out"][i] for i in plain[0]["out"])
    for x in plain + spec:
        del x["out"]
    ratio = {
        k: statistics.median(x[k] for x in plain) / statistics.median(x[k] for x in spec) for k in ("cpu_s", "wall_s")
    }
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
    import torch

    from libs.runtime import model_store

    torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", 1)))  # one thread: CPU time is its time
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
