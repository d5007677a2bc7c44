"""`switchyard bench --workload structured`: grammar-constrained against unconstrained output tokens per second.

One server, per concurrency level and grammar (a JSON schema, a regex), in rounds of one request per stream: the
constrained run, then its unconstrained twins, each asking for as many new tokens as its constrained answer took,
with fresh prompts of the same length (no prefix-cache help). The model is served from its own folder (its EOS ids
end a grammar). Every constrained answer must validate; the server's metrics and log give each side's steps, tokens
per step, step time, prefix hits and the shard's grammar work. Also the grammars' compile times and the same ratio
in process (bench/step/structured.py). structured.json and structured.md go to the output folder.

    switchyard bench --workload structured --model gemma --structured-streams 1,16
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

from bench import clock, machine
from bench.serving import loadgen, servers

# An object a random-weight model fills up to its length bounds (so answers stay a few dozen tokens) and a trained
# model answers in a similar length: strings, an array with bounded items and a number.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 8, "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "tags", "score"],
}
REGEX = r"[A-Z][a-z]{2,10}( [a-z]{2,10}){8,16}\."
KINDS = {
    "json": {"type": "json", "value": SCHEMA},
    "regex": {"type": "regex", "value": REGEX},
}


# ---- what the server did during a run: its /metrics and its log (steps, sampled tokens per step, the shard's step
# time, prefix-cache hits, and the shard's grammar work: services/shard/grammar/runner.py logs its running totals)
ROWS = "switchyard_constrained_rows_sum"  # the masked rows of every step, summed
STEPS = "tgi_batch_inference_count"  # steps planned (prefill and decode)
FORWARD_S, FORWARD_N = "tgi_batch_forward_duration_sum", "tgi_batch_forward_duration_count"  # the shard's steps
PREFIX_HITS = "switchyard_prefix_cache_hit_tokens_total"  # prompt tokens taken from the prefix cache


def metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return loadgen.parse_metrics(r.read().decode())


def settled(url: str, name: str, at_least: float | None = None, settle_s: float = 3.0, limit_s: float = 60.0):
    """The server's metrics once `name` has reached `at_least` (if given) and not moved for `settle_s`; at most
    `limit_s`. The services report their metrics with their heartbeats, seconds late on a loaded machine."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + limit_s
    while True:
        m = metrics(url)
        value, now = m.get(name, 0.0), time.monotonic()
        if value != last:
            last, since = value, now
        if now >= deadline or ((at_least is None or value >= at_least) and now - since >= settle_s):
            return m
        time.sleep(0.5)


def server_side(before: dict, after: dict, output_tokens: int) -> dict:
    """What the server did for one run: steps, sampled tokens per step, the shard's mean step time, prefix hits
    (those must be alike on both sides: a prompt already cached skips its prefill)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (STEPS, FORWARD_S, FORWARD_N, PREFIX_HITS, ROWS)}
    steps = delta[STEPS]
    return {
        "steps": steps,
        "tokens_per_step": output_tokens / steps if steps else None,
        "forward_ms": 1000 * delta[FORWARD_S] / delta[FORWARD_N] if delta[FORWARD_N] else None,
        "prefix_hit_tokens": delta[PREFIX_HITS],
        "constrained_rows": delta[ROWS],
    }


def grammar_totals(log_path: Path | None) -> dict[str, float]:
    """The shard's last `grammar totals:` log line (services/shard/grammar/runner.py, cumulative), as numbers."""
    if log_path is None or not log_path.exists():
        return {}
    lines = re.findall(r"grammar totals: ((?:\w+=[0-9.]+ ?)+)", log_path.read_text(errors="replace"))
    return {k: float(v) for k, v in (field.split("=", 1) for field in lines[-1].split())} if lines else {}


def grammar_side(before: dict, after: dict) -> dict:
    """The shard's grammar work over one run: ms per constrained step on the step's path (open + apply + advance)
    and on the worker beside the forward pass (fill ahead), and whether the shortcuts fired."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("steps", 0.0)

    def per_step(seconds: float) -> float | None:
        return 1000 * seconds / steps if steps else None

    return {
        "steps": steps,
        "rows_per_step": d.get("rows", 0.0) / steps if steps else None,
        "path_ms_per_step": per_step(d.get("open_s", 0.0) + d.get("apply_s", 0.0) + d.get("advance_s", 0.0)),
        "fill_ahead_ms_per_step": per_step(d.get("fill_ahead_s", 0.0)),
        "compiled": d.get("compiled", 0.0),
        "reused": d.get("reused", 0.0),
        "ahead_rows": d.get("ahead_rows", 0.0),
        "inline_rows": d.get("inline_rows", 0.0),
        "sparse_rows": d.get("sparse_rows", 0.0),  # chosen among their few allowed ids (no full-row pass)
        "cached_rows": d.get("cached_rows", 0.0),  # masks copied from a regex state seen before (regex_states.py)
    }


def add_arguments(p) -> None:
    g = p.add_argument_group("--workload structured")
    g.add_argument("--structured-streams", default="1,16", help="comma-separated client counts")
    g.add_argument("--structured-kinds", default="json,regex", help="grammars to measure: json, regex")
    g.add_argument("--structured-waves", type=int, default=2, help="requests per level = waves × streams")
    g.add_argument("--structured-prompt-tokens", type=int, default=64)
    g.add_argument("--structured-max-new-tokens", type=int, default=128,
                   help="the constrained requests' limit (an answer cut off by it counts as invalid)")  # fmt: skip
    g.add_argument("--structured-step-steps", type=int, default=32,
                   help="decode steps of the in-process ratio (bench/step/structured.py) at the largest "
                   "stream count; 0: skip it")  # fmt: skip


class _GrammarDialect(loadgen.Dialect):
    """TGI's /generate_stream with `parameters.grammar` (None: unconstrained); keeps each answer's text."""

    def __init__(self, grammar: dict | None):
        super().__init__("tgi", grammar=grammar)

    def read(self, event: dict, sample: loadgen.Sample, now: float) -> None:
        super().read(event, sample, now)
        if event.get("generated_text") is not None:
            sample.text = event["generated_text"]  # the final event's whole answer
            sample.finish = (event.get("details") or {}).get("finish_reason")


def model_folder(model: str) -> tuple[str, Path]:
    """(label, folder with the model's EOS ids): the grammar needs them to end an answer."""
    from bench import models

    if model in models.SHAPES:
        return model, models.build_llama(model)
    if model == "gemma":
        from libs.runtime import model_store

        return "gemma-3-270m", Path(model_store.resolve_model("gemma-3-270m"))
    return Path(model).name, Path(model)


def check(kind: str, text: str | None) -> str | None:
    """None if `text` is a valid answer for the grammar `kind`, else why not."""
    if text is None:
        return "no final text"
    if kind == "regex":
        return None if re.fullmatch(REGEX, text) else f"does not match the regex: {text[:80]!r}"
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]} in {text[:80]!r}"
    return None


def paired(jobs: list[loadgen.Job], samples: list[loadgen.Sample], prompts) -> list[loadgen.Job]:
    """The unconstrained twins of `jobs`: each asks for as many new tokens as its constrained answer took, with a
    fresh prompt of the same token count. Reusing the constrained prompts would let the prefix cache skip their
    prefills, and the unconstrained side would win by what it did not compute (short answers after long prompts:
    the prefills would dominate)."""
    out = []
    for job, sample in zip(jobs, samples):
        prompt, tokens = prompts.make(job.prompt_tokens)
        out.append(loadgen.Job(prompt, tokens, max(1, sample.tokens)))
    return out


def _add(total: dict, before: dict, after: dict) -> None:
    """Accumulate what changed between two readings (metrics or grammar totals) into `total`."""
    for k, v in after.items():
        total[k] = total.get(k, 0.0) + v - before.get(k, 0.0)


def _level(
    url: str, kind: str, jobs: list[loadgen.Job], twins, streams: int, log: Path | None = None, rows_before: float = 0.0
) -> dict:
    """One (kind, streams) pair, in rounds of `streams` requests: each round's constrained run, then its paired
    unconstrained one (`twins`: the Prompts that give the unconstrained side its own prompts), so that the host's
    drift over the level hits both sides alike (one constrained run then one unconstrained run of the whole level
    put minutes between them). `log`: the server's log, where the shard writes its grammar totals (those of a
    run's last rows when the next run's first step drops them: read once the paired unconstrained run is done).
    `rows_before`: the masked rows the server has sampled before this level (its metric must reach them first: the
    scheduler reports its metrics with its heartbeats, seconds apart when rendering them is slow, so a level would
    otherwise count the warm-up's late rows as its own)."""
    con, free = [], []
    walls = [0.0, 0.0]
    seen: list[dict] = [{}, {}]  # per side: the server's metrics deltas
    grammar: dict = {}
    cut, invalid = [], []
    m0, g0 = settled(url, ROWS, at_least=rows_before), grammar_totals(log)
    for start in range(0, len(jobs), streams):
        part = jobs[start : start + streams]
        got, c0, c1 = asyncio.run(loadgen.drive(url, _GrammarDialect(KINDS[kind]), part, streams))
        # every token of a constrained answer was sampled from a masked row, the first one in its prefill step
        expected = sum(s.tokens for s in got if s.error is None)
        m1 = settled(url, ROWS, at_least=m0.get(ROWS, 0.0) + expected)
        # an answer cut by max_new_tokens is a prefix, not a violation (a random-weight model may fill a schema's
        # free whitespace until the limit): those are counted apart; every answer the grammar ended must validate
        cut += [s for s in got if s.error is None and getattr(s, "finish", None) == "length"]
        ended = [s for s in got if s.error is None and getattr(s, "finish", None) != "length"]
        invalid += [why for s in ended for why in [check(kind, getattr(s, "text", None))] if why]
        plain, u0, u1 = asyncio.run(loadgen.drive(url, _GrammarDialect(None), paired(part, got, twins), streams))
        m2 = settled(url, STEPS, at_least=m1.get(STEPS, 0.0) + max(s.tokens for s in plain))  # a step per token
        # the shard writes the constrained run's last totals when its last rows are dropped, at the unconstrained
        # run's first step: read after that run (which adds nothing to them), or the run's tail is never counted
        g1 = grammar_totals(log)
        _add(grammar, g0, g1)
        _add(seen[0], m0, m1)
        _add(seen[1], m1, m2)
        m0, g0 = m2, g1  # settled: the next round starts from them
        con, free = con + got, free + plain
        walls[0] += c1 - c0
        walls[1] += u1 - u0
    c, u = loadgen.summarize(con, 0.0, walls[0]), loadgen.summarize(free, 0.0, walls[1])
    done = [s for s in con if s.error is None]
    server = {
        "constrained": server_side({}, seen[0], c["output_tokens"]),
        "unconstrained": server_side({}, seen[1], u["output_tokens"]),
    }
    server["constrained"]["grammar"] = grammar_side({}, grammar)
    return {
        "kind": kind,
        "streams": streams,
        "requests": len(jobs),
        "constrained": c,
        "unconstrained": u,
        "ratio": c["output_tok_s"] / u["output_tok_s"] if u["output_tok_s"] else None,
        "tokens_per_request": c["output_tokens"] / max(1, len(done)),
        "unconstrained_tokens": u["output_tokens"],
        "prompt_tokens": [sum(s.prompt_tokens for s in con), sum(s.prompt_tokens for s in free)],
        "valid": len(done) - len(cut) - len(invalid),
        "cut_by_length": len(cut),
        "invalid": invalid[:5],
        "errors": c["errors"] + u["errors"],
        "first_error": c["first_error"] or u["first_error"],
        "server": server,
        "constrained_rows": server["constrained"]["constrained_rows"],  # > 0: the masks were applied
        "constrained_rows_unconstrained_run": server["unconstrained"]["constrained_rows"],  # 0: no mask on plain ones
    }


def tools(n: int = 12) -> list[dict]:
    """n functions of a few typed parameters each, as an agent framework sends them."""
    out = []
    for i in range(n):
        params = {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "what to look up"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                "mode": {"enum": ["fast", "exact", f"mode{i}"]},
                "filters": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["query"],
        }
        out.append({"type": "function", "function": {"name": f"tool_{i}", "description": f"tool {i}",
                                                       "parameters": params}})  # fmt: skip
    return out


def compile_times(folder: Path, repeats: int = 10) -> dict:
    """Per grammar: the tokenizer's compile (an LLMatcher against the served tokenizer.json, as the tokenizer
    service checks a request's grammar, its cache bypassed), p50 / p90 ms over `repeats`."""
    from llguidance import LLMatcher, LLTokenizer

    from bench.serving.loadgen import percentile
    from libs.runtime import model_store
    from services.tokenizer.grammar import grammar_text, tool_grammar

    eos = model_store.model_info(folder)["eos_token_ids"]
    t0 = clock.wall()
    tok = LLTokenizer(str(folder / "tokenizer.json"), eos_token=[int(i) for i in eos])
    out = {"tokenizer_load_s": clock.wall() - t0}
    texts = {
        "json schema (the bench's)": grammar_text(KINDS["json"])[1],
        "regex (the bench's)": grammar_text(KINDS["regex"])[1],
        "12 tools, tool_choice required": tool_grammar(tools(), "required").text,
        "12 tools, tool_choice auto": tool_grammar(tools(), "auto").text,
    }
    for name, text in texts.items():
        ms = []
        for _ in range(repeats):
            t0 = clock.wall()
            m = LLMatcher(tok, text, log_level=0)
            ms.append((clock.wall() - t0) * 1000)
            if m.is_error():
                raise RuntimeError(f"{name}: {m.get_error()}")
        out[name] = {"p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "grammar_bytes": len(text)}
    return out


def _in_process(folder: Path, batch: int, steps: int, dtype: str) -> dict:
    """The ModelRunner's decode step with and without the grammar, in a process of its own (as the limit runs)."""
    import subprocess

    cmd = [sys.executable, "-m", "bench.step.structured", "--model", str(folder), "--batch", str(batch)]
    cmd += ["--steps", str(steps), "--dtype", dtype]
    res = subprocess.run(cmd, cwd=servers.ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"structured_step failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _f(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    lines = [
        f"{results['title']}",
        "",
        "| grammar | streams | unconstrained tok/s | constrained tok/s | ratio | tokens/request "
        "| valid (+ cut by length) | TTFT p50 free / constrained ms | ITL p50 free / constrained ms "
        "| constrained rows | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in results["levels"]:
        c, u = r["constrained"], r["unconstrained"]
        lines.append(
            f"| {r['kind']} | {r['streams']} | {_f(u['output_tok_s'])} | {_f(c['output_tok_s'])} "
            f"| {_f(r['ratio'], 2)} | {_f(r['tokens_per_request'])} "
            f"| {r['valid']}/{r['requests']} (+{r['cut_by_length']}) "
            f"| {_f(u['ttft_p50_ms'])} / {_f(c['ttft_p50_ms'])} "
            f"| {_f(u['itl_p50_ms'])} / {_f(c['itl_p50_ms'])} | {r['constrained_rows']:.0f} | {r['errors']} |"
        )
    lines += ["", "Server side per run (from /metrics; prefix-cache hits must be alike, or one side skipped prefills):",
              "", "| grammar | streams | steps free / constrained | tokens per step | shard step ms "
              "| prefix-cache hit tokens | grammar ms/step on path + beside | matchers compiled / copied "
              "| masks ahead / inline (of them remembered) |", "|---|---:|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["levels"]:
        u, c = r["server"]["unconstrained"], r["server"]["constrained"]
        g = c.get("grammar", {})
        lines.append(
            f"| {r['kind']} | {r['streams']} | {u['steps']:.0f} / {c['steps']:.0f} "
            f"| {_f(u['tokens_per_step'])} / {_f(c['tokens_per_step'])} "
            f"| {_f(u['forward_ms'])} / {_f(c['forward_ms'])} "
            f"| {u['prefix_hit_tokens']:.0f} / {c['prefix_hit_tokens']:.0f} "
            f"| {_f(g.get('path_ms_per_step'), 2)} + {_f(g.get('fill_ahead_ms_per_step'), 2)} "
            f"| {g.get('compiled', 0):.0f} / {g.get('reused', 0):.0f} "
            f"| {g.get('ahead_rows', 0):.0f} / {g.get('inline_rows', 0):.0f} ({g.get('cached_rows', 0):.0f}) |"
        )
    for r in results["levels"]:
        for why in r["invalid"]:
            lines.append(f"\n{r['kind']} streams={r['streams']} invalid: {why}")
        if r["first_error"]:
            lines.append(f"\n{r['kind']} streams={r['streams']} error: {r['first_error']}")
    step = results.get("in_process")
    if step:
        lines += ["", "In process (ModelRunner decode steps, every row under a JSON schema vs none; ms per step; "
                  "masks filled ahead on a worker, or inline with every core):", "",
                  "| batch | unconstrained step | constrained step | ratio | CPU-s ratio | choice (free / constrained) "
                  "| apply | advance | inline step | inline ratio | inline apply |",
                  "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in step["runs"]:
            u, c = r["unconstrained"], r["constrained"]
            i = r.get("inline") or {}
            lines.append(f"| {step['batch']} | {_f(u['step_ms'])} | {_f(c['step_ms'])} | {_f(r['ratio'], 2)} "
                         f"| {_f(r.get('ratio_cpu'), 2)} "
                         f"| {_f(u.get('sample_ms_per_step'), 2)} / {_f(c.get('sample_ms_per_step'), 2)} "
                         f"| {_f(c['apply_ms_per_step'], 2)} | {_f(c['advance_ms_per_step'], 2)} "
                         f"| {_f(i.get('step_ms'))} | {_f(r.get('ratio_inline'), 2)} "
                         f"| {_f(i.get('apply_ms_per_step'), 2)} |")  # fmt: skip
    compiles = results.get("compile")
    if compiles:
        lines += ["", f"Grammar compile (tokenizer load {compiles['tokenizer_load_s']:.1f} s):", "",
                  "| grammar | bytes | p50 ms | p90 ms |", "|---|---:|---:|---:|"]  # fmt: skip
        for name, c in compiles.items():
            if isinstance(c, dict):
                lines.append(f"| {name} | {c['grammar_bytes']} | {_f(c['p50_ms'])} | {_f(c['p90_ms'])} |")
    lines += ["", f"CPU: {results['cpu']}; load average {results['load_avg']}"]
    return "\n".join(lines)


def write(results: dict, out: Path) -> list[Path]:
    paths = [out / "structured.json", out / "structured.md"]
    paths[0].write_text(json.dumps(results, indent=2, default=str))
    paths[1].write_text(table(results) + "\n")
    return paths


def run(args, out: Path) -> int:
    from bench.serving.workload import Prompts
    from libs.runtime.cpu import choose_dtype

    label, folder = model_folder(args.model)
    dtype = choose_dtype(None).dtype if args.dtype == "auto" else args.dtype
    streams = [int(c) for c in args.structured_streams.split(",") if c.strip()]
    kinds = [k.strip() for k in args.structured_kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--structured-kinds: unknown {unknown} (known: {', '.join(KINDS)})")
    prompts, twins = Prompts(folder), Prompts(folder, seed=1)  # twins: the unconstrained side's own prompts
    results = {
        "title": f"structured output, {label} ({dtype}): prompt {args.structured_prompt_tokens} tokens, "
        f"constrained answers up to {args.structured_max_new_tokens}",
        "model": label,
        "model_dir": str(folder),
        "dtype": dtype,
        "command": " ".join(sys.argv),
        "cpu": machine.processor(),
        "load_avg": machine.load(),
        "schema": SCHEMA,
        "regex": REGEX,
        "levels": [],
    }
    print(f"switchyard bench --workload structured: {results['title']}; results in {out}", flush=True)
    results["compile"] = compile_times(folder)  # before the server: its processes would share the cores
    flags = ["--dtype", dtype, *args.serve_flag]
    with servers.switchyard(folder, out / "structured-switchyard.log", *flags) as srv:
        srv.wait_healthy(600)
        warm = Prompts(folder, seed=99)
        rows = 0.0  # the masked rows the server has sampled so far (each constrained token is one)
        for c in streams:
            # an unmeasured wave per level, both ways: first-use costs (oneDNN shapes, grammar caches) stay out
            for grammar in (*(KINDS[k] for k in kinds), None):
                got, _, _ = asyncio.run(loadgen.drive(srv.url, _GrammarDialect(grammar), warm.fixed(c, 16, 8), c))
                rows += sum(s.tokens for s in got if s.error is None) if grammar is not None else 0
            for kind in kinds:
                jobs = prompts.fixed(args.structured_waves * c, args.structured_prompt_tokens,
                                     args.structured_max_new_tokens)  # fmt: skip
                t0 = clock.wall()
                r = _level(srv.url, kind, jobs, twins, c, srv.log_path, rows)
                rows += r["constrained_rows"] + r["constrained_rows_unconstrained_run"]
                r["seconds"] = clock.wall() - t0
                results["levels"].append(r)
                print(f"  {kind:<5} streams {c:<3} unconstrained {r['unconstrained']['output_tok_s']:7.1f} tok/s  "
                      f"constrained {r['constrained']['output_tok_s']:7.1f} tok/s  ratio {_f(r['ratio'], 2)}  "
                      f"valid {r['valid']}/{r['requests']}  errors {r['errors']}", flush=True)  # fmt: skip
                write(results, out)  # after every level: a run cut short keeps what it measured
    if args.structured_step_steps > 0:
        results["in_process"] = _in_process(folder, max(streams), args.structured_step_steps, dtype)
        step = results["in_process"]
        print(f"  in process, batch {max(streams)}: ratio {step['ratio']:.2f} (masks filled ahead; CPU seconds "
              f"{step['ratio_cpu']:.2f}), {step['ratio_inline']:.2f} (inline)", flush=True)  # fmt: skip
    results["load_avg_end"] = machine.load()
    paths = write(results, out)
    print(table(results))
    print(f"written: {', '.join(str(p) for p in paths)}")
    bad = sum(r["requests"] - r["valid"] - r["cut_by_length"] for r in results["levels"])
    fired = all(r["constrained_rows"] > 0 for r in results["levels"])
    if bad or not fired:
        print(f"FAILED: {bad} constrained answers invalid or missing; masks applied in every level: {fired}")
        return 1
    return 0
