"""torch's CPU linear (MKL) against oneDNN with prepacked weights, on a model's own matrix shapes.

Why the shard switches its linear layers (services/shard/cpu_linear.py): this prints, per batch size (the M of a
decode step), the median time of every distinct (in, out) shape of the model both ways, measured interleaved in
one process so that load on the machine hits both alike, and the whole decode step's share of them.

    python -m launcher.bench.linear --model DIR [--batch 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

from launcher.bench.timing import median_ms


def measure(model_dir: str, batches: list[int], rounds: int = 5) -> list[dict]:
    import torch
    from transformers import AutoConfig

    from services.shard.cpu_linear import PACK_FOR_BATCH

    cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    # (in, out) -> count in one forward: q, k, v, o, gate, up, down per layer, and the LM head once
    shapes = Counter()
    for k, n in (
        (hidden, q),
        (hidden, kv),
        (hidden, kv),
        (q, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ):
        shapes[(k, n)] += cfg.num_hidden_layers
    shapes[(hidden, cfg.vocab_size)] += 1
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in batches:
        total = {"torch": 0.0, "onednn": 0.0}
        for (k, n), count in shapes.items():
            w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH)
            ways = {
                "torch": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "onednn": lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], ""),
            }
            reps = 3 if n * k > 20_000_000 else 10
            got = {name: [] for name in ways}
            for fn in ways.values():
                fn()
            for _ in range(rounds):  # interleaved: both see the same load
                for name, fn in ways.items():
                    got[name].append(median_ms(fn, reps))
            med = {name: statistics.median(v) for name, v in got.items()}
            for name in total:
                total[name] += med[name] * count
            rows.append({"batch": m, "in": k, "out": n, "per_forward": count, **{f"{a}_ms": b for a, b in med.items()}})
        rows.append({"batch": m, "in": "all", "out": "", "per_forward": sum(shapes.values()),
                     **{f"{a}_ms": b for a, b in total.items()}})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as the shard)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    rows = measure(args.model, [int(b) for b in args.batch.split(",")])
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| batch | in x out | per forward | torch (MKL) ms | oneDNN ms | speed-up |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        shape = "all linears" if r["in"] == "all" else f"{r['in']} x {r['out']}"
        speed = r["torch_ms"] / r["onednn_ms"] if r["onednn_ms"] else 0.0
        times = f"{r['torch_ms']:.2f} | {r['onednn_ms']:.2f}"
        print(f"| {r['batch']} | {shape} | {r['per_forward']} | {times} | {speed:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
