"""`switchyard bench --workload lora`: multi-LoRA serving against the same server's base-model throughput.

One server with `--lora-count` adapters (built once with peft on the bench model: every attention and MLP
projection, rank `--lora-ranks` in turn, random non-zero weights). At each `--lora-concurrency`, `--lora-rounds`
pairs of waves of the same shape: every request on the base model, then requests spread round robin over the base
model and the adapters (`--lora-base-share` on the base). The figure is the median of each pair's mix / base
throughput; every wave has prompts of its own and an unmeasured wave goes first; the scheduler's
`switchyard_scheduler_lora_generated_total` shows every adapter token ran. lora.json and lora.md go to the output
folder.

    switchyard bench --workload lora [--model smollm2] [--lora-concurrency 16,64] [--lora-rounds 2]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import urllib.request
from pathlib import Path

from bench import machine, models
from bench.serving import loadgen, servers
from bench.serving.loadgen import Job
from bench.serving.workload import Prompts

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_STD = 0.02  # LoRA A and B: non-zero, at the base weights' scale (transformers' init std)


def add_arguments(p) -> None:
    g = p.add_argument_group("--workload lora")
    g.add_argument("--lora-concurrency", default="16,64", help="comma-separated client counts (lora workload)")
    g.add_argument("--lora-count", type=int, default=4, help="adapters loaded and spread over (lora workload)")
    g.add_argument("--lora-ranks", default="16", help="adapter ranks, given to the adapters in turn (e.g. 8,16)")
    g.add_argument("--lora-base-share", type=float, default=0.2,
                   help="fraction of the mixed wave's requests on the base model (lora workload)")  # fmt: skip
    g.add_argument("--lora-rounds", type=int, default=1, help="base + mixed wave pairs per concurrency (median)")


@dataclasses.dataclass
class AdapterJob(Job):
    adapter: str | None = None


class AdapterDialect(loadgen.Dialect):
    """TGI's stream with `parameters.adapter_id` where the job names an adapter."""

    def __init__(self) -> None:
        super().__init__("tgi")

    def request(self, job: Job) -> tuple[str, dict]:
        path, body = super().request(job)
        if getattr(job, "adapter", None):
            body["parameters"]["adapter_id"] = job.adapter
        return path, body


def build_adapters(model_dir: Path, label: str, count: int, ranks: list[int]) -> dict[str, Path]:
    """name → folder of `count` peft adapters on `model_dir`, built once (cached next to the bench models)."""
    out = {}
    for i in range(count):
        r = ranks[i % len(ranks)]
        name = f"lora{i}-r{r}"
        folder = models.CACHE / "lora" / label / name
        if not (folder / "adapter_model.safetensors").exists():
            _build_one(model_dir, folder, r, seed=100 + i)
        out[name] = folder
    return out


def _build_one(model_dir: Path, folder: Path, r: int, seed: int) -> None:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=PROJECTIONS)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:  # peft starts B at zero: the adapter would be a no-op
                p.copy_(torch.randn(p.shape, generator=gen) * ADAPTER_STD)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(folder)


def _lora_tokens(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return loadgen.parse_metrics(r.read().decode()).get("switchyard_scheduler_lora_generated_total", 0.0)


def _jobs(view: Path, seed: int, count: int, args, adapters: list[str | None]) -> list[AdapterJob]:
    """`count` jobs of fresh prompts, the i-th on adapters[i % len(adapters)]."""
    prompts = Prompts(view, seed=seed)
    base = prompts.fixed(count, args.prompt_tokens, args.output_tokens)
    return [AdapterJob(j.prompt, j.prompt_tokens, j.max_new_tokens, adapters[i % len(adapters)])
            for i, j in enumerate(base)]  # fmt: skip


def _rotation(names: list[str], base_share: float) -> list[str | None]:
    """One cycle of the mixed wave's adapters: each adapter once, and base rows for about `base_share`."""
    if not 0 <= base_share < 1:
        raise ValueError("--lora-base-share must be in [0, 1)")
    base_rows = round(len(names) * base_share / (1 - base_share))
    return [None] * base_rows + list(names)


def _wave(url: str, jobs: list[AdapterJob], c: int, kind: str) -> dict:
    before = _lora_tokens(url)
    out = asyncio.run(loadgen.run_level(url, AdapterDialect(), jobs, c, metrics=False))
    out.pop("series", None)
    # the adapters' tokens as the schedulers counted them (their counters arrive with heartbeats, a beat late)
    expected = sum(j.max_new_tokens for j in jobs if j.adapter)
    deadline = time.monotonic() + 30
    while (counted := _lora_tokens(url) - before) < expected and time.monotonic() < deadline:
        time.sleep(0.25)
    out["lora_tokens"], out["lora_tokens_expected"] = counted, expected
    out["kind"] = kind
    print(f"  {kind:<5} c={c:<3} {out['output_tok_s']:8.1f} tok/s  TTFT p50 {out['ttft_p50_ms'] or 0:7.0f} ms  "
          f"ITL p50 {out['itl_p50_ms'] or 0:6.1f} ms  errors {out['errors']}", flush=True)  # fmt: skip
    if out["errors"]:
        raise RuntimeError(f"{out['errors']} of {out['requests']} requests failed: {out['first_error']}")
    return out


def _median(values: list[float]) -> float:
    xs = sorted(values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def table(results: dict) -> str:
    lines = [
        f"{results['title']}",
        f"CPU: {results['cpu']}",
        "",
        "| streams | base tok/s | LoRA mix tok/s | LoRA / base | each round | TTFT p50 ms base / mix "
        "| ITL p50 ms base / mix |",
        "|---:|---:|---:|---:|---|---|---|",
    ]
    for row in results["levels"]:
        b, m = row["base"], row["mix"]
        lines.append(
            f"| {row['concurrency']} | {row['base_tok_s']:.1f} | {row['mix_tok_s']:.1f} | {100 * row['ratio']:.0f}% "
            f"| {' '.join(f'{100 * r:.0f}' for r in row.get('round_ratios', [row['ratio']]))} "
            f"| {b['ttft_p50_ms'] or 0:.0f} / {m['ttft_p50_ms'] or 0:.0f} "
            f"| {b['itl_p50_ms'] or 0:.1f} / {m['itl_p50_ms'] or 0:.1f} |"
        )
    lines.append("")
    lines.append(f"Target: LoRA / base >= 85 %. Load average {results['load_avg_start']} → {results['load_avg_end']}.")
    return "\n".join(lines)


def run(args, out: Path) -> int:
    from libs.runtime.cpu import choose_dtype

    label, view = models.resolve(args.model)
    dtype = choose_dtype(None).dtype if args.dtype == "auto" else args.dtype
    ranks = [int(r) for r in args.lora_ranks.split(",") if r.strip()]
    levels = [int(c) for c in args.lora_concurrency.split(",") if c.strip()]
    adapters = build_adapters(view, label, args.lora_count, ranks)
    names = list(adapters)
    rotation = _rotation(names, args.lora_base_share)
    results = {
        "title": f"LoRA serving, {label}: {len(names)} adapters (r {args.lora_ranks}, all projections), "
        f"{sum(a is None for a in rotation)}/{len(rotation)} of the mixed requests on the base model; "
        f"prompt {args.prompt_tokens}, output {args.output_tokens} tokens ({dtype})",
        "cpu": machine.processor(),
        "command": " ".join(sys.argv),
        "adapters": {n: str(p) for n, p in adapters.items()},
        "load_avg_start": machine.load(),
        "levels": [],
    }
    print(
        f"switchyard bench --workload lora: {results['title']}\n  CPU: {results['cpu']}; results in {out}", flush=True
    )
    flags = ["--dtype", dtype, "--lora-adapters", ",".join(f"{n}={p}" for n, p in adapters.items())]
    flags += ["--max-loras", str(max(len(names), 1)), "--max-lora-rank", str(max(ranks)), *args.serve_flag]
    seed = 1000
    with servers.switchyard(view, out / "switchyard-lora.log", *flags) as srv:
        srv.wait_healthy(600)
        for c in levels:
            count = args.waves * c
            base_runs, mix_runs = [], []
            # one unmeasured mixed wave at this concurrency: per-shape set-up stays out of both figures
            asyncio.run(loadgen.drive(srv.url, AdapterDialect(), _jobs(view, seed, c, args, rotation), c))
            seed += 1
            for _ in range(args.lora_rounds):
                base_runs.append(_wave(srv.url, _jobs(view, seed, count, args, [None]), c, "base"))
                mix_runs.append(_wave(srv.url, _jobs(view, seed + 1, count, args, rotation), c, "mix"))
                seed += 2
            base_tok_s = _median([r["output_tok_s"] for r in base_runs])
            mix_tok_s = _median([r["output_tok_s"] for r in mix_runs])
            for r in mix_runs:  # every adapter token counted: the adapters really ran
                if r["lora_tokens"] < r["lora_tokens_expected"]:
                    raise RuntimeError(f"the server counted {r['lora_tokens']:.0f} LoRA tokens of "
                                       f"{r['lora_tokens_expected']}: the adapters did not run")  # fmt: skip
            # the figure: the median of each round's mix / base (the two waves of a round run back to back, so
            # the host's drift over a run mostly cancels within a round)
            pairs = [m["output_tok_s"] / b["output_tok_s"] for b, m in zip(base_runs, mix_runs)]
            results["levels"].append({"concurrency": c, "base_tok_s": base_tok_s, "mix_tok_s": mix_tok_s,
                                      "ratio": _median(pairs), "round_ratios": pairs, "base": base_runs[-1],
                                      "mix": mix_runs[-1], "base_runs": base_runs, "mix_runs": mix_runs})  # fmt: skip
    results["load_avg_end"] = machine.load()
    text = table(results)
    (out / "lora.json").write_text(json.dumps(results, indent=2))
    (out / "lora.md").write_text(text + "\n")
    print(text)
    print(f"written: {out / 'lora.json'}, {out / 'lora.md'}")
    return 0
