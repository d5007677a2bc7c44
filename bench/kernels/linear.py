"""torch's CPU linear against oneDNN with prepacked weights, in float32 and bfloat16, on a model's own shapes.

Why the shard switches its linear layers (services/shard/model/onednn.py): this prints, per batch size (the M of a
decode step), the median time of every distinct (in, out) product of the model's decode step as the shard runs it
(q/k/v and gate/up fused, the LM head) four ways — torch fp32 (MKL), oneDNN fp32, torch bf16, oneDNN bf16 —
measured interleaved in one process so that load on the machine hits all alike, and the whole step's sum of them.
bf16 is measured only where oneDNN runs it on this CPU (onednn.dtype_supported).

    python -m bench.kernels.linear --model smollm2|gemma|llama-128k|DIR [--batch 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

from bench import machine
from bench.clock import median_ms

WAYS = ("torch_fp32", "onednn_fp32", "torch_bf16", "onednn_bf16")


def step_shapes(cfg) -> Counter:
    """(in, out) -> count of the products in one decode forward, fused as the shard fuses them."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    shapes = Counter()
    for k, n in ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)):
        shapes[(k, n)] += cfg.num_hidden_layers
    shapes[(hidden, cfg.vocab_size)] += 1  # the LM head
    return shapes


def measure(model_dir: str, batches: list[int], rounds: int = 5) -> list[dict]:
    import torch
    from transformers import AutoConfig

    from services.shard.model import onednn

    shapes = step_shapes(AutoConfig.from_pretrained(model_dir).get_text_config())
    ways = [w for w in WAYS if w != "onednn_bf16" or onednn.dtype_supported(torch.bfloat16)]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in batches:
        total = dict.fromkeys(ways, 0.0)
        for (k, n), count in shapes.items():
            w32, x32 = torch.randn(n, k, generator=gen) * 0.02, torch.randn(m, k, generator=gen)
            w16, x16 = w32.bfloat16(), x32.bfloat16()
            calls = {}
            for name, x, w in (("fp32", x32, w32), ("bf16", x16, w16)):
                calls[f"torch_{name}"] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
                if f"onednn_{name}" in ways:
                    packed = onednn.pack(w)
                    calls[f"onednn_{name}"] = lambda x=x, p=packed, n=n: onednn.linear(x, p, None, n)
            reps = 3 if n * k > 20_000_000 else 10
            got = {name: [] for name in ways}
            for name in ways:
                calls[name]()
            for _ in range(rounds):  # interleaved: all see the same load
                for name in ways:
                    got[name].append(median_ms(calls[name], reps))
            med = {name: statistics.median(v) for name, v in got.items()}
            for name in ways:
                total[name] += med[name] * count
            rows.append({"batch": m, "in": k, "out": n, "per_forward": count, **{f"{a}_ms": b for a, b in med.items()}})
        rows.append({"batch": m, "in": "all", "out": "", "per_forward": sum(shapes.values()),
                     **{f"{a}_ms": b for a, b in total.items()}})  # fmt: skip
    return rows


def table(rows: list[dict]) -> list[str]:
    ways = [w for w in WAYS if f"{w}_ms" in rows[0]]
    head = " | ".join(f"{w} ms" for w in ways)
    lines = [f"| batch | in x out | per forward | {head} | oneDNN bf16 vs torch bf16 | vs oneDNN fp32 |"]
    lines.append("|---:|---|---:|" + "---:|" * (len(ways) + 2))
    for r in rows:
        shape = "all linears" if r["in"] == "all" else f"{r['in']} x {r['out']}"
        times = " | ".join(f"{r[f'{w}_ms']:.3f}" for w in ways)
        if "onednn_bf16_ms" in r:
            best = r["onednn_bf16_ms"]
            ratios = f"{r['torch_bf16_ms'] / best:.2f}x | {r['onednn_fp32_ms'] / best:.2f}x"
        else:
            ratios = "- | -"
        lines.append(f"| {r['batch']} | {shape} | {r['per_forward']} | {times} | {ratios} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a benchmark model's name (bench/models.py) or a folder")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as the shard)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from bench import models

    _, folder = models.resolve(args.model)
    rows = measure(str(folder), [int(b) for b in args.batch.split(",")])
    print(json.dumps(rows) if args.json else "\n".join([machine.line(), "", *table(rows)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
