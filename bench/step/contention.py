"""The OpenMP team under contention: the shard's decode step with another process busy on the same cores, the old
fixed team (every usable core, unpinned) against the team decided from others' load (libs/runtime/cpu_team.py),
round after round in one process, so the figure is a ratio within one run.

A busy process (a Python spin loop, as a benchmark client on the same machine is) runs during the `--busy 1` phase;
`--busy 0` is the light-load check (both should then pick the same team). Each round measures the others' load
over a short window (as the shard does at start and while serving), applies each candidate's team and times
`--steps` decode steps of the batch.

    python -m bench.step.contention --model smollm2 --batch 16 --rounds 3 --steps 8 --busy 0,1   # prints JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench import clock, machine, models
from bench.step.limit import Batch
from libs.runtime import cpu, cpu_team

SPIN = "while True: pass"


def _team(name: str, usable: tuple[int, ...], sampler: cpu_team.Sampler) -> cpu_team.TeamPlan:
    import torch

    if name == "fixed":
        plan = cpu_team.TeamPlan(len(usable), usable, (), "", "every usable core, unpinned")
    else:
        sampler.sample()  # a fresh window: the load while this candidate waits, not the other candidate's steps
        time.sleep(cpu_team.START_WINDOW_S)
        plan = cpu_team.decide(usable, sampler.sample(), cpu_team.CpuFlags())
    torch.set_num_threads(plan.threads)
    cpu_team.pin_process(plan.cpus or usable)
    return plan


def _steps(b: Batch, n: int) -> list[float]:
    out = []
    while len(out) < n:
        if not b.has_work():  # the batch ran out: a new one (the same request ids), prefilled unmeasured
            b.engine.outputs.clear()
            b.start()
            b.prefill()
            continue
        with clock.Lap() as lap:
            b.engine.step()
        out.append(lap.wall * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a bench model name (bench/models.py) or a folder")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per candidate and round")
    ap.add_argument("--busy", default="0,1", help="busy processes beside the step, per phase (comma-separated)")
    args = ap.parse_args(argv)
    _, model_dir = models.resolve(args.model) if not os.path.isdir(args.model) else (args.model, args.model)
    usable = cpu_team.usable_cpus()
    b = Batch(str(model_dir), args.batch, args.prompt_tokens, args.output_tokens, dtype=args.dtype)
    b.warm()
    b.start()
    b.prefill()
    sampler = cpu_team.Sampler()
    phases = []
    for busy in [int(x) for x in args.busy.split(",")]:
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
        try:
            rounds = []
            for _ in range(args.rounds):
                row = {}
                for name in ("fixed", "decided"):
                    plan = _team(name, usable, sampler)
                    row[name] = {"step_ms_p50": statistics.median(_steps(b, args.steps)), "threads": plan.threads,
                                 "cpus": cpu_team.format_cpus(plan.cpus) if plan.cpus else "-"}  # fmt: skip
                row["speedup"] = row["fixed"]["step_ms_p50"] / row["decided"]["step_ms_p50"]
                rounds.append(row)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        phases.append({"busy": busy, "rounds": rounds,
                       "speedup_median": statistics.median(r["speedup"] for r in rounds)})  # fmt: skip
    out = {"cpu": cpu.describe(), "usable": cpu_team.format_cpus(usable), "load_avg": machine.load(),
           "args": vars(args), "phases": phases}  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
