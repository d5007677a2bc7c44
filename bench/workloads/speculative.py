"""`switchyard bench --workload speculative`: `--speculate 0` against `--speculate N`, real servers, greedy.

Workloads (`--spec-workloads`), on `--spec-model` (default: the default model, chat-tuned) through its chat template:
copy ("Say exactly this": a short numbered list to quote, what prompt lookup is for), free (a short story: few
drafts match, and services/scheduler/drafting.py must turn drafting down) and json (the list written out under a
JSON schema: titles copied, every pick masked by the grammar). Both servers are up at once; at each
`--spec-concurrency` c they take turns of 3 × c requests with c clients (closed loop, `--spec-waves` turns each),
reading the draft and accepted counters around each level. tok/s counts the tokens generated while all c clients
were busy; the two servers' greedy outputs are compared. results.json and results.md go to the output folder.

    switchyard bench --workload speculative --spec-concurrency 1,16 --spec-workloads copy,free
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from pathlib import Path

from bench import machine
from bench.serving import loadgen, servers

TOPICS = ["a lighthouse keeper", "a lost robot", "a city under the sea", "an old clock", "a dragon who bakes",
          "the last train", "a garden on Mars", "a talking cat", "a winter festival", "a map with no roads",
          "a shy volcano", "a library at night", "two rival chefs", "a paper boat", "a silent orchestra",
          "a mountain village"]  # fmt: skip


# the json workload's grammar: the document's rows as objects (titles copied from the prompt, page counts)
EXTRACT = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"title": {"type": "string"}, "pages": {"type": "integer"}},
                "required": ["title", "pages"],
            },
            "maxItems": 8,
        }
    },
    "required": ["items"],
}
GRAMMARS = {"json": {"type": "json", "value": EXTRACT}}


def dialect(workload: str) -> loadgen.Dialect:
    """TGI's /generate_stream, with the workload's grammar when it has one."""
    return loadgen.Dialect("tgi", grammar=GRAMMARS.get(workload))


def add_arguments(p) -> None:
    p.add_argument("--spec-model", default="default", help="speculative workload: `default` (the default model) "
                   "or a local folder (a chat model: the prompts go through its chat template)")  # fmt: skip
    p.add_argument("--spec-n", type=int, default=4, help="speculative workload: the --speculate N compared with 0")
    p.add_argument("--spec-concurrency", default="1,16", help="speculative workload: comma-separated stream counts")
    p.add_argument("--spec-waves", type=int, default=2,
                   help="speculative workload: turns per server and level (3 × c requests each)")  # fmt: skip
    p.add_argument("--spec-max-new", type=int, default=160, help="speculative workload: max_new_tokens per request")
    p.add_argument("--spec-workloads", default="copy,free",
                   help="speculative workload: copy, free and/or json (comma list)")  # fmt: skip


def _say(msg: str) -> None:
    print(msg, flush=True)


def document(i: int) -> str:
    """A short document of its own per request (a numbered list: titles and page counts), to be quoted."""
    rows = (f"{j + 1}. {TOPICS[(i + j) % len(TOPICS)]}, {(i * 7 + j * 3) % 50 + 1} pages" for j in range(8))
    return "\n".join(rows)


def prompts(model_dir: Path, workload: str, count: int, max_new: int) -> list[loadgen.Job]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    jobs = []
    for i in range(count):
        ask = {
            "copy": f"Say exactly this and nothing else: {document(i)}",
            "free": f"Write a short story about {TOPICS[i % len(TOPICS)]}.",
            "json": f"Write this list as JSON, each row an item with its title and pages:\n{document(i)}",
        }[workload]
        text = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False)
        jobs.append(loadgen.Job(text, len(tok(text, add_special_tokens=False).input_ids), max_new))
    return jobs


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def counters(url: str) -> dict[str, float]:
    m = loadgen.parse_metrics(_get(url + "/metrics"))
    return {k: m.get(f"switchyard_speculative_{k}_tokens_total", 0.0) for k in ("draft", "accepted")}


def _generate(url: str, prompt: str, max_new: int, grammar: dict | None = None) -> str:
    params = {"max_new_tokens": max_new, **({"grammar": grammar} if grammar else {})}
    body = json.dumps({"inputs": prompt, "parameters": params}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["generated_text"]


TURN = 3  # a turn runs TURN × c requests with c clients: the level's rate is read while all c were busy


def steady(samples: list, started: float) -> tuple[float, float]:
    """(tokens, seconds) of a closed-loop turn while every client was busy: from its start to the last request sent
    (after that, slots free up and are not refilled: a row that finished early — a drafted one — would leave the
    batch smaller for the rest of the turn, which says more about the turn's length than about the server)."""
    last = max(s.sent for s in samples)
    tokens = 0.0
    for s in samples:
        if s.events:
            tokens += sum(t <= last for t in s.events) * s.tokens / len(s.events)
    return tokens, last - started


async def _alternate(servers_: list, todo: list, c: int, turns: int, dialect: loadgen.Dialect) -> list[dict]:
    """One level on every server: `turns` turns each of TURN × c requests with c clients, the servers taking turns
    (the order flipped each round) once the host is idle, so that the host's drift over the minutes of a level hits
    both alike (a shared machine's speed wanders within an hour: servers run one after the other carry that drift
    into their ratio)."""
    for srv in servers_:  # unmeasured: first-call costs out
        await loadgen.drive(srv.url, dialect, todo[:c], c)
    await loadgen.settle()
    before = [_settled_counters(srv.url) for srv in servers_]  # the warm-up's drafts reach /metrics a beat later
    samples: list[list] = [[] for _ in servers_]
    wall, busy = [0.0] * len(servers_), [[0.0, 0.0] for _ in servers_]
    size = TURN * c
    for w in range(turns):
        order = list(range(len(servers_)))
        for i in order if w % 2 == 0 else order[::-1]:
            await loadgen.settle()
            jobs = todo[c + w * size : c + (w + 1) * size]
            got, started, ended = await loadgen.drive(servers_[i].url, dialect, jobs, c)
            samples[i] += got
            wall[i] += ended - started
            tokens, seconds = steady(got, started)
            busy[i][0] += tokens
            busy[i][1] += seconds
    out = []
    for i, srv in enumerate(servers_):
        r = loadgen.summarize(samples[i], 0.0, wall[i])
        after = _settled_counters(srv.url)
        r.update(concurrency=c, steady_tok_s=busy[i][0] / max(busy[i][1], 1e-9), drafted=after["draft"] -
                 before[i]["draft"], accepted=after["accepted"] - before[i]["accepted"])  # fmt: skip
        out.append(r)
    return out


def _serve(model_dir: Path, out: Path, args, jobs: dict[str, list], checks: list) -> list[dict]:
    """Both servers (`--speculate 0` and N) up at once; every level alternates between them."""
    rows: list[dict] = [{"speculate": n, "levels": [], "answers": []} for n in (0, args.spec_n)]
    with contextlib.ExitStack() as stack:
        running = []
        for row in rows:
            flags = ["--speculate", str(row["speculate"]), "--dtype", args.spec_dtype, *args.serve_flag]
            log = out / f"speculate-{row['speculate']}.log"
            running.append(stack.enter_context(servers.switchyard(model_dir, log, *flags)))
        for srv in running:
            srv.wait_healthy(900)
        for workload, todo in jobs.items():
            for c in args.levels:
                level = asyncio.run(_alternate(running, todo, c, args.spec_waves, dialect(workload)))
                for row, r in zip(rows, level):
                    if r["errors"]:
                        raise RuntimeError(f"speculate {row['speculate']} {workload} c={c}: {r['errors']} failed: "
                                           f"{r['first_error']}")  # fmt: skip
                    r["workload"] = workload
                    row["levels"].append(r)
                    _say(f"  speculate {row['speculate']} {workload:<5} c={c:<3} {r['steady_tok_s']:8.1f} tok/s "
                         f"(whole turns {r['output_tok_s']:.1f})  "
                         f"ITL p50 {r['itl_p50_ms'] or 0:6.1f} ms  drafted {r['drafted']:.0f} "
                         f"accepted {r['accepted']:.0f}")  # fmt: skip
        for row, srv in zip(rows, running):
            row["answers"] = [_generate(srv.url, j.prompt, j.max_new_tokens, GRAMMARS.get(w)) for w, j in checks]
    return rows


def _settled_counters(url: str) -> dict[str, float]:
    """The counters once a heartbeat after the level carried them (they travel about once a second)."""
    last, deadline = counters(url), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = counters(url)
        if now == last:
            return now
        last = now
    return last


def table(results: dict) -> str:
    rows = {r["speculate"]: r for r in results["rows"]}
    base, spec = rows.get(0), rows.get(results["n"])
    lines = [results["title"], f"CPU: {results['cpu']}", "",
             f"| workload | streams | tok/s --speculate 0 | tok/s --speculate {results['n']} | ratio | "
             "whole turns | ITL p50 ms (0 / N) | drafted | accepted | acceptance |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    if base and spec:
        for lb, ls in zip(base["levels"], spec["levels"]):
            ratio = ls["steady_tok_s"] / lb["steady_tok_s"] if lb["steady_tok_s"] else 0.0
            whole = ls["output_tok_s"] / lb["output_tok_s"] if lb["output_tok_s"] else 0.0
            share = ls["accepted"] / ls["drafted"] if ls["drafted"] else 0.0
            lines.append(f"| {ls['workload']} | {ls['concurrency']} | {lb['steady_tok_s']:.1f} | "
                         f"{ls['steady_tok_s']:.1f} | {ratio:.2f}× | {whole:.2f}× | {lb['itl_p50_ms'] or 0:.1f} / "
                         f"{ls['itl_p50_ms'] or 0:.1f} | {ls['drafted']:.0f} | {ls['accepted']:.0f} | "
                         f"{100 * share:.0f}% |")  # fmt: skip
        same = sum(a == b for a, b in zip(base["answers"], spec["answers"]))
        lines.append(
            f"\ngreedy outputs identical with and without speculation: {same}/{len(base['answers'])}"
            + (
                ""
                if results.get("exact")
                else " (bf16: a verified chunk's numerics differ from one-token "
                "steps', so greedy ties break otherwise; --dtype float32 is the exact mode)"
            )
        )
    for name, why in results.get("failed", {}).items():
        lines.append(f"\n{name}: {why}")
    return "\n".join(lines) + "\n"


def run(args, out: Path) -> int:
    from libs.runtime import cpu, model_store

    model_dir = model_store.resolve_model(None) if args.spec_model == "default" else Path(args.spec_model)
    args.spec_dtype = cpu.choose_dtype(None).dtype if args.dtype == "auto" else args.dtype
    args.levels = [int(c) for c in args.spec_concurrency.split(",") if c.strip()]
    most = (TURN * args.spec_waves + 1) * max(args.levels)
    workloads = [w.strip() for w in args.spec_workloads.split(",") if w.strip()]
    if set(workloads) - {"copy", "free", "json"} or args.spec_n < 1:
        raise SystemExit("error: --spec-workloads takes copy, free and/or json; --spec-n must be at least 1")
    jobs = {w: prompts(model_dir, w, most, args.spec_max_new) for w in workloads}
    checks = [(w, j) for w in workloads for j in jobs[w][:2]]
    results = {"title": f"{model_dir.name}: --speculate 0 vs {args.spec_n}, greedy, up to {args.spec_max_new} new "
               f"tokens, dtype {args.spec_dtype}", "cpu": machine.processor(), "command": " ".join(sys.argv),
               "n": args.spec_n, "load_avg_start": machine.load(), "rows": [], "failed": {},
               "exact": args.spec_dtype == "float32"}  # fmt: skip
    _say(f"switchyard bench --workload speculative: {results['title']}; CPU {results['cpu']}; results in {out}")
    try:
        results["rows"] = _serve(model_dir, out, args, jobs, checks)
    except (RuntimeError, TimeoutError, OSError) as e:
        results["failed"]["serving"] = str(e)[-800:]
        _say(f"  failed: {str(e)[-800:]}")
    results["load_avg_end"] = machine.load()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(table(results))
    _say(table(results))
    _say(f"written: {out / 'results.json'}, {out / 'results.md'}")
    same = len(results["rows"]) == 2 and results["rows"][0]["answers"] == results["rows"][1]["answers"]
    return 0 if (same or not results["exact"]) and not results["failed"] else 1
