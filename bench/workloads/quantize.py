"""`switchyard bench --workload quantize`: real servers, unquantized against each on-the-fly method that runs on CPU.

One server per `--quant-methods` entry (`none`: the float model; `method@dtype` pins the serving dtype) on `--model`.
Each is measured for: the shard's memory from /proc (the peak while loading, the RSS after the runs, also less the
KV cache, touched at start with SWITCHYARD_KV_PREFAULT=1 so every server holds the same); output tok/s, TTFT and ITL
at each `--quant-concurrency` (closed loop, exact lengths); the TTFT of a `--quant-long-prompt`-token prompt; and a
quality proxy against the first entry: greedy agreement before the first difference, and |Δ logprob| of the prompt
tokens (teacher-forced). Methods and kernels: docs/quantization.md. results.json and results.md go to the output
folder.

    switchyard bench --quantize none,eetq,bitsandbytes-nf4 --model smollm2 --quant-concurrency 1,16
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from bench import machine, models
from bench.serving import loadgen, servers
from bench.serving.workload import Prompts

DEFAULT_METHODS = "none,none@float32,eetq,bitsandbytes,bitsandbytes-nf4,bitsandbytes-fp4"


def add_arguments(p) -> None:
    p.add_argument("--quant-methods", default=DEFAULT_METHODS, help="quantize workload: comma-separated "
                   "`none` (float) or a --quantize method, each optionally @float32|bfloat16; the first is the "
                   "quality reference")  # fmt: skip
    p.add_argument("--quant-concurrency", default="1,16", help="quantize workload: comma-separated stream counts")
    p.add_argument("--quant-long-prompt", type=int, default=512, help="quantize workload: prompt tokens of the "
                   "prefill (TTFT) probe")  # fmt: skip
    p.add_argument("--quant-quality-prompts", type=int, default=8, help="quantize workload: prompts of the "
                   "greedy agreement / logprob comparison")  # fmt: skip
    p.add_argument("--quant-kv-tokens", type=int, help="quantize workload: --max-batch-total-tokens of every "
                   "server (default: what the largest level needs, at least 4096)")  # fmt: skip


def _say(msg: str) -> None:
    print(msg, flush=True)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def shard_pids(root: int) -> list[int]:
    """The shard processes (`python -m services.shard`) under `root` (the launcher: supervisord is its child)."""
    kids, todo, found = _children(), [root], []
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"services.shard" in argv:
            found.append(pid)
    return sorted(found)


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the peak resident so far) of a process, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB
    return out


def runtime_mib() -> float:
    """VmRSS of a process that imported what a shard imports and ran one product, with no model: the part of a
    shard's RSS that no quantization shrinks (interpreter, torch, oneDNN, transformers, the bus)."""
    import subprocess

    code = ("import torch, services.shard.__main__, services.shard.model_runner;"
            "torch.ones(64, 64) @ torch.ones(64, 64);"
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])")  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    return int(subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              check=True).stdout.split()[-1]) / 1024  # fmt: skip


def _generate(url: str, prompt: str, max_new: int) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new, "details": True,
                                             "decoder_input_details": True}}  # fmt: skip
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        details = json.loads(r.read())["details"]
    return {"ids": [t["id"] for t in details["tokens"]],
            "prefill": [t["logprob"] for t in details["prefill"][1:]]}  # fmt: skip


def quality(answers: list[dict], reference: list[dict]) -> dict:
    """Greedy agreement before the first difference (share of each continuation) and |Δ| of prompt logprobs."""
    agree, exact, deltas = [], 0, []
    for got, ref in zip(answers, reference):
        n = next((i for i, (a, b) in enumerate(zip(got["ids"], ref["ids"])) if a != b), min(len(got["ids"]),
                 len(ref["ids"])))  # fmt: skip
        agree.append(n / max(1, len(ref["ids"])))
        exact += got["ids"] == ref["ids"]
        deltas += [abs(a - b) for a, b in zip(got["prefill"], ref["prefill"]) if a is not None and b is not None]
    return {"greedy_agreement": statistics.fmean(agree) if agree else None, "greedy_exact": exact,
            "greedy_prompts": len(agree), "logprob_delta_mean": statistics.fmean(deltas) if deltas else None,
            "logprob_delta_max": max(deltas) if deltas else None}  # fmt: skip


def kv_mib(model_dir: Path, tokens: int, dtype: str) -> float:
    """The shard's KV cache for `tokens` (K and V, every layer, whole blocks of 16): part of its RSS, the same with
    or without quantization, and at the default 65,536 tokens several times a small model's weights."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    blocks = -(-tokens // 16)
    size = 4 if dtype == "float32" else 2
    return text["num_hidden_layers"] * 2 * kv_heads * head_dim * blocks * 16 * size / 2**20


def _split(entry: str, default_dtype: str) -> tuple[str, str]:
    method, _, dtype = entry.partition("@")
    return method.strip(), (dtype.strip() or default_dtype)


def _serve(view: Path, out: Path, method: str, dtype: str, args, prompts: Prompts, warm: Prompts,
           quality_jobs) -> dict:  # fmt: skip
    name = f"{method}@{dtype}"
    flags = ["--dtype", dtype, *([] if method == "none" else ["--quantize", method])]
    flags += ["--max-batch-total-tokens", str(args.quant_kv_tokens), *args.serve_flag]
    row: dict = {"method": method, "dtype": dtype, "levels": [], "kv_mib": kv_mib(view, args.quant_kv_tokens, dtype)}
    started = time.monotonic()
    with servers.switchyard(view, out / f"quantize-{name}.log", *flags) as srv:
        srv.wait_healthy(900)
        row["load_s"] = time.monotonic() - started
        pids = shard_pids(srv.proc.pid)
        if not pids:
            raise RuntimeError(f"{name}: no services.shard process under the launcher (pid {srv.proc.pid})")
        load = memory_mib(pids[0])
        row.update(load_peak_mib=load["VmHWM"], loaded_rss_mib=load["VmRSS"])
        dialect = loadgen.Dialect("tgi")
        asyncio.run(loadgen.drive(srv.url, dialect, warm.fixed(2, 8, 4), 2))  # first-call costs out of the figures
        for c in [int(c) for c in args.quant_concurrency.split(",") if c.strip()]:
            asyncio.run(loadgen.drive(srv.url, dialect, warm.fixed(c, args.prompt_tokens, 4), c))
            jobs = prompts.fixed(args.waves * c, args.prompt_tokens, args.output_tokens)
            r = asyncio.run(loadgen.run_level(srv.url, dialect, jobs, c, metrics=False))
            r.pop("series", None)
            if r["errors"]:
                raise RuntimeError(f"{name} c={c}: {r['errors']} requests failed: {r['first_error']}")
            row["levels"].append(r)
            _say(f"  {name:<24} c={c:<3} {r['output_tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_ms'] or 0:7.0f} ms  "
                 f"ITL p50 {r['itl_p50_ms'] or 0:7.1f} ms")  # fmt: skip
        long = warm.fixed(3, args.quant_long_prompt, 1)
        samples, _, _ = asyncio.run(loadgen.drive(srv.url, dialect, long, 1))
        ttfts = [s.ttft for s in samples if s.error is None and s.ttft is not None]
        row["long_prompt_ttft_ms"] = statistics.median(ttfts) * 1000 if ttfts else None
        row["answers"] = [_generate(srv.url, j.prompt, j.max_new_tokens) for j in quality_jobs]
        after = memory_mib(pids[0])
        row.update(serving_rss_mib=after["VmRSS"], serving_peak_mib=after["VmHWM"])
        row["rss_less_kv_mib"] = after["VmRSS"] - row["kv_mib"]
    _say(f"  {name:<24} shard load peak {row['load_peak_mib']:.0f} MiB, loaded {row['loaded_rss_mib']:.0f} MiB, "
         f"serving {row['serving_rss_mib']:.0f} MiB; {args.quant_long_prompt}-token prompt TTFT "
         f"{row['long_prompt_ttft_ms'] or 0:.0f} ms")  # fmt: skip
    return row


def _f(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    rows = results["rows"]
    levels = sorted({lv["concurrency"] for r in rows for lv in r["levels"]})
    base = rows[0] if rows else None
    head = ["method", "dtype", *[f"tok/s c={c}" for c in levels], *[f"ITL p50 ms c={c}" for c in levels],
            f"TTFT {results['long_prompt']}-tok ms", "shard load peak MiB", "shard RSS MiB", "KV MiB",
            "RSS − KV MiB", "RSS − KV vs first", "model MiB (RSS − KV − runtime)", "model vs first",
            "greedy agree", "abs Δ logprob mean / max"]  # fmt: skip
    lines = [f"{results['title']}", f"CPU: {results['cpu']}",
             f"runtime (a shard's imports, no model): {_f(results.get('runtime_mib'))} MiB", "",
             "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]  # fmt: skip
    for r in rows:
        by_c = {lv["concurrency"]: lv for lv in r["levels"]}
        q = r.get("quality") or {}
        cells = [r["method"], r["dtype"]]
        cells += [_f(by_c[c]["output_tok_s"], 1) if c in by_c else "–" for c in levels]
        cells += [_f(by_c[c]["itl_p50_ms"], 1) if c in by_c else "–" for c in levels]
        cells += [_f(r.get("long_prompt_ttft_ms")), _f(r.get("load_peak_mib")), _f(r.get("serving_rss_mib"))]
        cells += [_f(r.get("kv_mib")), _f(r.get("rss_less_kv_mib"))]
        share = r["rss_less_kv_mib"] / base["rss_less_kv_mib"] if base and r.get("rss_less_kv_mib") else None
        cells.append("–" if share is None else f"{100 * share:.0f}%")
        runtime = results.get("runtime_mib")
        model = r["rss_less_kv_mib"] - runtime if runtime and r.get("rss_less_kv_mib") else None
        base_model = base["rss_less_kv_mib"] - runtime if runtime and base and base.get("rss_less_kv_mib") else None
        cells += [_f(model), "–" if not (model and base_model) else f"{100 * model / base_model:.0f}%"]
        agree = q.get("greedy_agreement")
        cells.append("–" if agree is None else f"{100 * agree:.0f}% ({q['greedy_exact']}/{q['greedy_prompts']})")
        cells.append(f"{_f(q.get('logprob_delta_mean'), 4)} / {_f(q.get('logprob_delta_max'), 3)}")
        lines.append("| " + " | ".join(cells) + " |")
    for name, why in results.get("failed", {}).items():
        lines.append(f"\n{name}: {why}")
    return "\n".join(lines) + "\n"


def _write(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(table(results))


def run(args, out: Path) -> int:
    from libs.runtime import cpu
    from libs.runtime.settings import env_name

    label, view = models.resolve(args.model)
    dtype = cpu.choose_dtype(None).dtype if args.dtype == "auto" else args.dtype
    # the shards touch their whole KV cache at start (it is otherwise resident only as its blocks are used), so
    # that "RSS − KV" is what the model and the runtime hold, whatever the levels touched
    os.environ[env_name("kv_prefault")] = "1"
    entries = [_split(e, dtype) for e in args.quant_methods.split(",") if e.strip()]
    top = max(int(c) for c in args.quant_concurrency.split(",") if c.strip())
    need = max(top * (args.prompt_tokens + args.output_tokens), args.quant_long_prompt + 1)
    args.quant_kv_tokens = args.quant_kv_tokens or max(4096, -(-need // 1024) * 1024)
    prompts, warm = Prompts(view), Prompts(view, seed=99)
    quality_jobs = Prompts(view, seed=7).fixed(args.quant_quality_prompts, args.prompt_tokens, args.output_tokens)
    results = {"title": f"{label}: quantized serving, prompt {args.prompt_tokens}, output {args.output_tokens} "
               f"tokens, default dtype {dtype}", "model": label, "cpu": machine.processor(),
               "command": " ".join(sys.argv), "long_prompt": args.quant_long_prompt, "load_avg_start": machine.load(),
               "rows": [],
               "failed": {}, "runtime_mib": runtime_mib()}  # fmt: skip
    _say(f"switchyard bench --workload quantize: {results['title']}; CPU {results['cpu']}; results in {out}")
    reference = None
    for method, mdtype in entries:
        try:
            row = _serve(view, out, method, mdtype, args, prompts, warm, quality_jobs)
        except (RuntimeError, TimeoutError, OSError) as e:  # keep what the others measure
            results["failed"][f"{method}@{mdtype}"] = str(e)[-800:]
            _say(f"  {method}@{mdtype} failed: {str(e)[-800:]}")
            continue
        if reference is None:
            reference = row["answers"]
        row["quality"] = quality(row["answers"], reference)
        results["rows"].append(row)
        _write(results, out)  # after every server: a run cut short keeps what it measured
    results["load_avg_end"] = machine.load()
    _write(results, out)
    _say(table(results))
    _say(f"written: {out / 'results.json'}, {out / 'results.md'}")
    return 0 if results["rows"] and not results["failed"] else 1
