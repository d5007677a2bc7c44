"""What the server did during one run of the structured workload (launcher.bench.structured), from its /metrics
and its log: steps, sampled tokens per step, the shard's step time, prefix-cache hits, and the shard's grammar
work (services/shard/grammar/runner.py logs its running totals)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from launcher.bench import loadgen

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
