"""`switchyard bench --n N`: what parallel sampling costs. One prompt of `--prompt-tokens` tokens and one new token
(so the prefill is nearly all the work), through a real server's /v1/completions: one request with n=1, one with
n=N (N sibling sequences, the prompt prefilled once and its full KV blocks forked), and N distinct prompts at once
(what N choices would cost if each computed its prompt). Wall times are medians of `--n-repeats` rounds, the three
alternating; the scheduler's sibling_shared_tokens counter shows the fork ran. results.json and results.md go to
the output folder.

    switchyard bench --model smollm2 --n 4 --prompt-tokens 1024
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench import machine, models
from bench.serving import servers
from bench.serving.workload import Prompts


def _say(msg: str) -> None:
    print(msg, flush=True)


def _completion(url: str, prompt: str, n: int) -> float:
    body = {"prompt": prompt, "n": n, "max_tokens": 1, "temperature": 1.0, "ignore_eos": True}
    started = time.perf_counter()
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    assert len(r.json()["choices"]) == n
    return time.perf_counter() - started


def _shared(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=60).text
    m = re.search(r'^switchyard_scheduler_sibling_shared_tokens_total\{index="0"\} (\d+)$', text, re.M)
    return int(m.group(1)) if m else 0


def measure(url: str, view: Path, n: int, prompt_tokens: int, repeats: int) -> dict:
    prompts = Prompts(view, seed=7)
    times: dict[str, list[float]] = {"n=1": [], f"n={n}": [], f"{n} prompts": []}
    _completion(url, prompts.make(prompt_tokens)[0], n)  # warm
    before = _shared(url)
    with ThreadPoolExecutor(n) as pool:
        for r in range(repeats):
            runs = [
                ("n=1", lambda: _completion(url, prompts.make(prompt_tokens)[0], 1)),
                (f"n={n}", lambda: _completion(url, prompts.make(prompt_tokens)[0], n)),
                (
                    f"{n} prompts",
                    lambda: max(
                        pool.map(lambda p: _completion(url, p, 1), [prompts.make(prompt_tokens)[0] for _ in range(n)])
                    ),
                ),
            ]
            for name, run in runs if r % 2 == 0 else runs[::-1]:
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    deadline, shared = time.monotonic() + 30, 0
    while time.monotonic() < deadline and shared <= 0:  # the counter travels in the scheduler's heartbeat
        time.sleep(0.5)
        shared = _shared(url) - before
    medians = {name: statistics.median(v) * 1000 for name, v in times.items()}
    one = medians["n=1"]
    return {
        "n": n,
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "median_ms": medians,
        "ratio_to_n1": {name: v / one for name, v in medians.items()},
        "sibling_shared_tokens": shared,
    }


def run(args, out: Path) -> int:
    label, view = models.resolve(args.model)
    if args.dtype == "auto":
        from libs.runtime.cpu import choose_dtype

        args.dtype = choose_dtype(None).dtype
    results = {"model": label, "command": " ".join(sys.argv), "machine": machine.info()}
    _say(f"switchyard bench --n {args.n}: {label}, prompt {args.prompt_tokens} tokens, 1 new token ({args.dtype})")
    if args.url:
        results["parallel"] = measure(args.url, view, args.n, args.prompt_tokens, args.n_repeats)
    else:
        with servers.switchyard(view, out / "switchyard.log", "--dtype", args.dtype, *args.serve_flag) as server:
            server.wait_healthy(600)
            results["parallel"] = measure(server.url, view, args.n, args.prompt_tokens, args.n_repeats)
    p = results["parallel"]
    lines = [
        "| request | median ms | × n=1 |",
        "|---|---|---|",
        *(f"| {k} | {v:.0f} | {p['ratio_to_n1'][k]:.2f} |" for k, v in p["median_ms"].items()),
        "",
        f"sibling_shared_tokens: {p['sibling_shared_tokens']} over {p['repeats']} n={p['n']} requests + the warm-up",
    ]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _say("\n".join(lines))
    return 0
