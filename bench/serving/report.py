"""The benchmark's outputs: results.json, a Markdown table (results.md) and a PNG plot (results.png)."""

from __future__ import annotations

import json
from pathlib import Path


def _f(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    """Markdown tables: the limit, then every engine's runs (tok/s as a fraction of the limit where known)."""
    lines = []
    limits = {r["batch"]: r for r in results.get("limit", [])}
    if limits:
        lines += [
            "| batch | limit out tok/s | decode-only tok/s | decode step ms | prefill s |",
            "|---:|---:|---:|---:|---:|",
        ]
        for b, r in sorted(limits.items()):
            lines.append(
                f"| {b} | {_f(r['tok_s'], 1)} | {_f(r['decode_tok_s'], 1)} | {_f(r['decode_step_ms'], 1)} "
                f"| {_f(r['prefill_s'], 2)} |"
            )
        lines.append("")
    lines += [
        "| engine | workload | conc | out tok/s | of limit | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
        "| step overhead ms | errors |",
        "|---|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for run in results.get("runs", []):
        c = run["concurrency"]
        limit = limits.get(c) if run.get("workload") == "fixed" else None
        frac = f"{100 * run['output_tok_s'] / limit['tok_s']:.0f}%" if limit and limit["tok_s"] else "–"
        # per-step cost outside the forward: a decode step seen by the client minus the same step in-process
        over = None
        if limit and run.get("itl_p50_ms") is not None:
            over = run["itl_p50_ms"] - limit["decode_step_ms"]
        lines.append(
            f"| {run['engine']} | {run.get('workload', '')} | {c} | {_f(run['output_tok_s'], 1)} | {frac} "
            f"| {_f(run['ttft_p50_ms'])} / {_f(run['ttft_p90_ms'])} / {_f(run['ttft_p99_ms'])} "
            f"| {_f(run['itl_p50_ms'], 1)} / {_f(run['itl_p90_ms'], 1)} / {_f(run['itl_p99_ms'], 1)} "
            f"| {_f(over, 1)} | {run['errors']} |"
        )
    costs = [run for run in results.get("runs", []) if run.get("cpu_s_per_1k_tokens")]
    if costs:  # where the CPU went: each server process's CPU seconds per 1,000 generated tokens
        lines += ["", "| engine | workload | conc | CPU s per 1k tokens, by process |", "|---|---|---:|---|"]
        for run in costs:
            per = ", ".join(f"{role} {v:.2f}" for role, v in run["cpu_s_per_1k_tokens"].items())
            lines.append(f"| {run['engine']} | {run.get('workload', '')} | {run['concurrency']} | {per} |")
    for run in results.get("runs", []):
        if run.get("errors"):
            lines.append(f"\n{run['engine']} {run.get('workload', '')} c={run['concurrency']}: {run['first_error']}")
    scale = results.get("scaling")
    if scale:
        lines += ["", "| workers | workload | conc | out tok/s | prompt tok/s | req/s | TTFT p50 ms | ITL p50 ms |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in scale["runs"]:
            lines.append(
                f"| T={r['tokenizers']} K={r['detokenizers']} | {r['workload']} | {r['concurrency']} "
                f"| {_f(r['output_tok_s'], 1)} | {_f(r['prompt_tok_s'], 0)} | {_f(r['requests_s'], 2)} "
                f"| {_f(r['ttft_p50_ms'])} | {_f(r['itl_p50_ms'], 1)} |"
            )
        h = scale["hops"]
        lines.append(
            f"\nHops per token (tiny model, concurrency 1): client inter-token p50 {_f(h['itl_p50_ms'], 2)} ms − "
            f"in-process decode step {_f(h['in_process_step_ms'], 2)} ms = {_f(h['per_token_hops_ms'], 2)} ms"
        )
    for name, why in results.get("skipped", {}).items():
        lines.append(f"\n{name}: {why}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    """Four panels: output tok/s, TTFT p50, ITL p50 against concurrency (per engine, with the limit), and
    Switchyard's KV use and batch size over time at its highest concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    runs = [r for r in results.get("runs", []) if r.get("workload") == "fixed"]
    engines = sorted({r["engine"] for r in runs})
    panels = [(ax[0][0], "output_tok_s", "output tok/s"), (ax[0][1], "ttft_p50_ms", "TTFT p50 (ms)")]
    panels.append((ax[1][0], "itl_p50_ms", "inter-token p50 (ms)"))
    for a, key, label in panels:
        for e in engines:
            pts = sorted((r["concurrency"], r[key]) for r in runs if r["engine"] == e and r.get(key) is not None)
            if pts:
                a.plot(*zip(*pts), marker="o", label=e)
        a.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in runs})
        if levels:
            a.set_xticks(levels, [str(c) for c in levels])
        a.set_xlabel("concurrency")
        a.set_ylabel(label)
        a.grid(True, alpha=0.3)
    limit = sorted((r["batch"], r["tok_s"]) for r in results.get("limit", []))
    if limit:
        ax[0][0].plot(*zip(*limit), linestyle="--", color="black", label="limit (in-process runner)")
    step = sorted((r["batch"], r["decode_step_ms"]) for r in results.get("limit", []))
    if step:
        ax[1][0].plot(*zip(*step), linestyle="--", color="black", label="limit decode step")
    for a in (ax[0][0], ax[1][0]):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    a = ax[1][1]
    ours = [r for r in runs if r["engine"].startswith("switchyard") and r.get("series")]
    if ours:
        top = max(ours, key=lambda r: r["concurrency"])
        t = [p[0] for p in top["series"]]
        a.plot(t, [p[1] if p[1] is not None else float("nan") for p in top["series"]], label="KV use (fraction)")
        a2 = a.twinx()
        a2.plot(t, [p[2] if p[2] is not None else float("nan") for p in top["series"]], color="C1", label="batch")
        a2.set_ylabel("running batch size")
        a.set_title(f"{top['engine']} at concurrency {top['concurrency']}", fontsize=9)
        a.legend(loc="upper left", fontsize=8)
        a2.legend(loc="upper right", fontsize=8)
    a.set_xlabel("seconds")
    a.set_ylabel("KV use")
    fig.suptitle(results.get("title", "switchyard bench"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md", "png": out_dir / "results.png"}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["md"].write_text(table(results))
    plot(results, paths["png"])
    return paths
