"""Where an end-to-end step goes, process by process, beside the limit.

Starts Switchyard on a bench model, drives N streams (fixed prompts, exact output lengths) and reads over the
measured waves: from /metrics, the steps, the shard's forward and sampling per step, the scheduler's phases (plan,
sample, publish) and the shard's wait (the bus both ways and its work outside the forward); from /proc, each server
process's CPU ms per step net of what it burns idle, and its context switches; output tok/s and the TTFT spread.
With `--limit`, the in-process limit of the same shape (bench/step/limit.py) with its CPU ms per decode step: the
shard's CPU per step end to end against it is what the pipeline costs the shard, comparable on a busy machine.

    python -m bench.serving.pipeline --model llama-128k --concurrency 16 --prompt-tokens 32 --output-tokens 64 --limit
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import clock, models
from bench.serving import loadgen, servers
from bench.serving.workload import Prompts

STEPS = 'switchyard_scheduler_steps_total{index="0"}'


def process_tree(root: int) -> dict[int, str]:
    """pid → role (`services.shard`, `launcher`, …) of `root` and everything below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    roles, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        roles[pid] = args[args.index("-m") + 1] if "-m" in args[:-1] else Path(args[0]).name if args else "?"
    return roles


def cpu_and_switches(pid: int) -> tuple[float, int]:
    """(CPU seconds, context switches) summed over the threads of one process; (0, 0) once it is gone. CPU time
    from each thread's schedstat (nanoseconds; /proc/PID/stat counts 10 ms ticks, too coarse per step)."""
    cpu_ns = switches = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            cpu_ns += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if "ctxt_switches:" in line:  # voluntary and not
                    switches += int(line.split()[1])
    except (OSError, ValueError):
        return 0.0, 0
    return cpu_ns / 1e9, switches


def snapshot(pids) -> dict[int, tuple[float, int]]:
    return {pid: cpu_and_switches(pid) for pid in pids}


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and labels as written."""
    out = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def settled(url: str, every: float = 1.2, most: float = 30.0) -> dict[str, float]:
    """/metrics once two scrapes a heartbeat apart show the same step count (counters travel in heartbeats)."""
    last, deadline = scrape(url), time.monotonic() + most
    while time.monotonic() < deadline:
        time.sleep(every)
        now = scrape(url)
        if now.get(STEPS) == last.get(STEPS):
            return now
        last = now
    return last


def phase_ms(delta: dict[str, float], name: str, steps: float) -> dict[str, float]:
    """label value → ms per step of a histogram's _sum (e.g. the scheduler's phases)."""
    out = {}
    for key, value in delta.items():
        m = re.fullmatch(rf'{name}_sum\{{\w+="(\w+)"\}}', key)
        if m and value:
            out[m.group(1)] = 1000 * value / steps
    return out


def breakdown(delta: dict[str, float], steps: float) -> dict[str, float]:
    """The step's parts in ms per step, from /metrics deltas."""
    phases = phase_ms(delta, "switchyard_step_duration_seconds", steps)
    shard = sum(phase_ms(delta, "tgi_batch_forward_duration", steps).values())
    decodes = delta.get('tgi_batch_forward_duration_count{method="decode"}', 0.0)
    decode_s = delta.get('tgi_batch_forward_duration_sum{method="decode"}', 0.0)
    return {
        "shard_forward_ms": shard,
        # the decode-only steps' forward, comparable with the in-process limit's step (prefill steps are not in it)
        "decode_forward_ms": 1000 * decode_s / decodes if decodes else None,
        "shard_wait_ms": phases.get("forward", 0.0) - shard,  # sent → result, less the shard's own time
        "plan_ms": phases.get("plan", 0.0),
        "apply_ms": phases.get("sample", 0.0),
        "publish_ms": phases.get("publish", 0.0),  # overlaps the next step
    }


def in_process_limit(view: Path, args) -> dict:
    cmd = [sys.executable, "-m", "bench.step.limit", "--model", str(view), "--batch", str(args.concurrency)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens)]
    cmd += ["--dtype", args.dtype]
    res = subprocess.run(cmd, cwd=servers.ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"limit failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    label, view = models.resolve(args.model)
    if args.dtype == "auto":
        from libs.runtime.cpu import choose_dtype

        args.dtype = choose_dtype(None).dtype
    prompts, dialect = Prompts(view, seed=7), loadgen.Dialect("tgi")
    log = Path(args.out or ".bench") / "pipeline-switchyard.log"
    with servers.switchyard(view, log, "--dtype", args.dtype, *args.serve_flag) as srv:
        srv.wait_healthy(600)
        c = args.concurrency
        asyncio.run(loadgen.drive(srv.url, dialect, prompts.fixed(c, args.prompt_tokens, 4), c))  # warm, unmeasured
        roles = process_tree(srv.proc.pid)
        idle0 = snapshot(roles)
        time.sleep(args.idle_seconds)
        idle1, m0 = snapshot(roles), settled(srv.url)
        jobs = prompts.fixed(args.waves * c, args.prompt_tokens, args.output_tokens)
        t0, c0 = clock.wall(), snapshot(roles)
        samples, started, ended = asyncio.run(loadgen.drive(srv.url, dialect, jobs, c))
        wall, c1 = clock.wall() - t0, snapshot(roles)
        m1 = settled(srv.url)
    delta = {k: v - m0.get(k, 0.0) for k, v in m1.items()}
    steps = max(delta.get(STEPS, 0.0), 1.0)
    procs = []
    for pid, role in sorted(roles.items(), key=lambda kv: kv[1]):
        idle_rate = (idle1[pid][0] - idle0[pid][0]) / max(args.idle_seconds, 1e-9)
        cpu_s = c1[pid][0] - c0[pid][0]
        procs.append({"role": role, "pid": pid, "cpu_ms_per_step": 1000 * cpu_s / steps,
                      "net_cpu_ms_per_step": 1000 * (cpu_s - idle_rate * wall) / steps,
                      "switches_per_step": (c1[pid][1] - c0[pid][1]) / steps})  # fmt: skip
    summary = loadgen.summarize(samples, started, ended)
    out = {"model": label, "dtype": args.dtype, "concurrency": c, "steps": steps, "steps_per_s": steps / wall,
           "wall_s": wall, "tok_s": summary["output_tok_s"], "errors": summary["errors"],
           "ttft_ms": [summary["ttft_p50_ms"], summary["ttft_p90_ms"], max((s.ttft or 0) * 1000 for s in samples)],
           "step": breakdown(delta, steps), "processes": procs}  # fmt: skip
    if args.limit:
        out["limit"] = in_process_limit(view, args)
    return out


def show(r: dict) -> None:
    print(f"{r['model']} ({r['dtype']}), {r['concurrency']} streams: {r['tok_s']:.1f} tok/s, {r['steps']:.0f} steps "
          f"({r['steps_per_s']:.1f}/s), TTFT p50/p90/max {r['ttft_ms'][0]:.0f}/{r['ttft_ms'][1]:.0f}/"
          f"{r['ttft_ms'][2]:.0f} ms, errors {r['errors']}")  # fmt: skip
    print("per step, ms: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r["step"].items() if v is not None))
    print(f"{'process':<28} {'CPU ms/step':>12} {'net of idle':>12} {'switches/step':>14}")
    for p in r["processes"]:
        print(f"{p['role']:<28} {p['cpu_ms_per_step']:12.2f} {p['net_cpu_ms_per_step']:12.2f} "
              f"{p['switches_per_step']:14.1f}")  # fmt: skip
    rest = sum(p["net_cpu_ms_per_step"] for p in r["processes"] if p["role"] != "services.shard")
    print(f"{'all but the shard':<28} {'':>12} {rest:12.2f}")
    if "limit" in r:
        lim = r["limit"]
        print(
            f"in-process limit: {lim['tok_s']:.1f} tok/s, decode step {lim['decode_step_ms']:.2f} ms, "
            f"{lim.get('decode_step_cpu_ms', 0):.2f} CPU ms; end to end / limit: {r['tok_s'] / lim['tok_s']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-128k", help="a bench model (bench/models.py) or a folder")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="requests = waves × concurrency")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--idle-seconds", type=float, default=3.0, help="idle CPU measured this long before the load")
    ap.add_argument("--limit", action="store_true", help="also the in-process limit of the same shape")
    ap.add_argument("--serve-flag", action="append", default=[], help="an extra `switchyard serve` flag (repeat)")
    ap.add_argument("--out", help="folder for the server's log and pipeline.json (default .bench)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = ap.parse_args(argv)
    r = run(args)
    show(r)
    folder = Path(args.out or ".bench")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipeline.json").write_text(json.dumps(r, indent=1))
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
