"""The vision workload's report: the table (results.md), the plot (results.png) and results.json."""

from __future__ import annotations

import json
from pathlib import Path

from bench.serving import loadgen
from bench.workloads.vision.model import KINDS


def say(msg: str) -> None:
    print(msg, flush=True)


def ms(values: list[float], q: float) -> float | None:
    v = loadgen.percentile(values, q)
    return None if v is None else v * 1000


def _f(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    lines = [f"### {results['title']} — CPU {results['cpu']}", "", f"Model: {results['model_made']}.", ""]
    if results.get("prompt_tokens"):
        p = results["prompt_tokens"]
        sizes = ", ".join(f"{fmt} {kib:.0f} KiB" for fmt, kib in results.get("image_kib_mean", {}).items())
        lines += [
            f"An image request: {p['image']} prompt tokens, {p['image'] - p['text']} more than its text alone"
            + (f" (pictures on average: {sizes})." if sizes else "."),
            "",
        ]
    if results["levels"]:
        lines += ["| c | kind | prompt tokens | out tok/s | TTFT p50 / p90 ms | ITL p50 / p90 ms | images per request "
                  "| preprocess ms per image | encoder ms per image | errors |",
                  "|---:|---|---:|---:|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for r in results["levels"]:
            lines.append(f"| {r['concurrency']} | {r['kind']} | {_f(r['prompt_tokens'])} | {_f(r['output_tok_s'], 1)} "
                         f"| {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p90_ms'])} "
                         f"| {_f(r['itl_p50_ms'], 1)} / {_f(r['itl_p90_ms'], 1)} | {_f(r['images_per_request'], 2)} "
                         f"| {_f(r['preprocess_ms_per_image'], 1)} | {_f(r.get('encode_ms_per_image'), 1)} "
                         f"| {r['errors']} |")  # fmt: skip
        lines.append("")
        ratios = []
        for c in sorted({r["concurrency"] for r in results["levels"]}):
            by = {r["kind"]: r for r in results["levels"] if r["concurrency"] == c}
            img, same = by.get("image"), by.get("text, same tokens")
            if img and same and img["output_tok_s"] and same["output_tok_s"] and same["ttft_p50_ms"]:
                ratios.append(f"c={c}: TTFT ×{img['ttft_p50_ms'] / same['ttft_p50_ms']:.2f}, "
                              f"tok/s ×{img['output_tok_s'] / same['output_tok_s']:.2f}")  # fmt: skip
        if ratios:
            lines += ["Image against text of the same prompt tokens (p50 TTFT, output tok/s): " + "; ".join(ratios), ""]
    fl = results.get("flood")
    if fl:
        lines += [f"Flood check: {fl['streams']} text streams decoding, alone and while image requests arrive at "
                  f"{fl['rate']:g}/s (preprocessed by the tokenizers, queued behind the full batch):", "",
                  "| streams | gaps | ITL p50 ms | ITL mean ms | ITL p99 ms | images sent / preprocessed "
                  "| shard CPU ms per step | CPU s per s, by process |",
                  "|---|---:|---:|---:|---:|---|---:|---|"]  # fmt: skip
        for name in ("alone", "flood"):
            r = fl[name]
            cpu = ", ".join(f"{role} {v:.2f}" for role, v in r["cpu_per_s"].items() if v >= 0.01)
            lines.append(
                f"| {name} | {r['gaps']} | {_f(r['itl_p50_ms'], 1)} | {_f(r['itl_mean_ms'], 1)} "
                f"| {_f(r['itl_p99_ms'], 1)} | {r['images_sent']} / {r['images_preprocessed']:.0f} "
                f"| {_f(r['shard_cpu_ms_per_step'], 1)} | {cpu} |"
            )
        lines += ["", f"Gap with the flood / alone: p50 ×{_f(fl['ratio_p50'], 3)}, mean ×{_f(fl['ratio_mean'], 3)}, "
                  f"p99 ×{_f(fl['ratio_p99'], 3)} (within 10 %: p50 {_verdict(fl['ratio_p50'])}); the shard's CPU "
                  f"per step ×{_f(fl['ratio_shard_cpu_ms_per_step'], 3)}",
                  "Rounds (ITL p50 ms, load average): " + ", ".join(
                      f"{'flood' if r['flood'] else 'alone'} {_f(r['itl_p50_ms'], 1)} ({r['load_1m']:.1f})"
                      for r in fl["rounds"])]  # fmt: skip
    return "\n".join(lines)


def _verdict(ratio: float | None) -> str:
    return "–" if ratio is None else ("yes" if ratio <= 1.10 else "no")


def plot(results: dict, path: Path) -> Path:
    """Two panels: TTFT p50 and output tok/s per kind against concurrency; the flood check's gap percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    for a, key, label in ((ax[0], "ttft_p50_ms", "TTFT p50 (ms)"), (ax[1], "output_tok_s", "output tok/s")):
        for kind in KINDS:
            pts = sorted((r["concurrency"], r[key]) for r in results["levels"] if r["kind"] == kind and r[key])
            if pts:
                a.plot(*zip(*pts), marker="o", label=kind)
        levels = sorted({r["concurrency"] for r in results["levels"]})
        a.set_xscale("log", base=2)
        if levels:
            a.set_xticks(levels, [str(c) for c in levels])
        a.set_xlabel("concurrency")
        a.set_ylabel(label)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fl = results.get("flood")
    if fl:
        keys = [("itl_p50_ms", "p50"), ("itl_mean_ms", "mean"), ("itl_p99_ms", "p99")]
        x = range(len(keys))
        for i, name in enumerate(("alone", "flood")):
            ax[2].bar([j + 0.4 * i for j in x], [fl[name][k] or 0 for k, _ in keys], width=0.4, label=name)
        ax[2].set_xticks([j + 0.2 for j in x], [label for _, label in keys])
        ax[2].set_ylabel(f"inter-token gap of {fl['streams']} streams (ms)")
        ax[2].set_title(f"image flood {fl['rate']:g}/s", fontsize=9)
        ax[2].legend(fontsize=8)
    fig.suptitle(f"{results['title']} — {results['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(results: dict, out: Path) -> list[Path]:
    paths = [out / "results.json", out / "results.md", out / "results.png"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(table(results) + "\n")
    plot(results, paths[2])
    return paths
