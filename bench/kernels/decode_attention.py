"""Decode attention on CPU: one layer's attention of `rows` one-token rows over `context` cached keys each, the
paged attention's backends against each other as the shard calls them (`attend_layer`, the step's plan built
once): "torch" (the grouped path: gather the rows' pages, batched products) and "cpu" (the C++ kernel reading the
pages in place, services/shard/cpu_kernels/attention.cpp). Interleaved; each one's median µs and the torch / cpu
ratio. Outputs are checked against each other (bf16 rounding apart) before anything is timed.

    python -m bench.kernels.decode_attention [--rows 1,16,64] [--context 96,1000,4000] [--shape llama-64,gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench import clock, machine
from bench.kernels.attention import SHAPES

BLOCK = 16


def case(rows: int, context: int, shape: tuple, seed: int = 0) -> dict:
    """The pages, block tables and the step's q/k/v for `rows` rows of `context` cached tokens, in bf16."""
    import numpy as np
    import torch

    heads, kv_heads, head_dim = shape[:3]
    g = torch.Generator().manual_seed(seed)
    per_row = -(-(context + 1) // BLOCK)
    blocks = rows * per_row + 1
    pages = [tuple(torch.randn(kv_heads, blocks, BLOCK, head_dim, generator=g).to(torch.bfloat16) for _ in "kv")]
    tables = torch.randperm(blocks, generator=g)[: rows * per_row].view(rows, per_row).numpy().astype(np.int64)
    qkv = [torch.randn(rows, n, head_dim, generator=g).to(torch.bfloat16) for n in (heads, kv_heads, kv_heads)]
    return dict(
        pages=pages, tables=tables, qkv=qkv, cu=np.arange(rows + 1), context=np.full(rows, context),
        slots=tables[:, context // BLOCK] * BLOCK + context % BLOCK, scaling=shape[4],
    )  # fmt: skip


def batch(c: dict, backend: str):
    """The step's PagedBatch for `backend`, as the runner builds it once per step (its plan is built on the first
    layer's call and shared by the others)."""
    import torch

    from services.shard.attention.paged import PagedBatch

    return PagedBatch.from_host(c["pages"], c["slots"], c["cu"], c["context"], c["tables"], BLOCK,
                                torch.device("cpu"), backend=backend)  # fmt: skip


def run(c: dict, paged):
    """One layer's call as the shard makes it."""
    from services.shard.attention.paged import attend_layer

    return attend_layer(0, *c["qkv"], paged, c["scaling"], None, 0)


def measure(rows: int, context: int, shape: tuple, rounds: int = 5, calls: int = 20) -> dict:
    c = case(rows, context, shape)
    batches = {b: batch(c, b) for b in ("torch", "cpu")}
    want, got = run(c, batches["torch"]).float(), run(c, batches["cpu"]).float()
    drift = (want - got).abs().max().item()
    if drift > 0.05 * want.abs().max().item():
        raise AssertionError(f"the backends disagree by {drift} at rows {rows}, context {context}")
    times: dict[str, list[float]] = {b: [] for b in batches}
    for _ in range(rounds):
        for backend, paged in batches.items():
            start = clock.wall()
            for _ in range(calls):
                run(c, paged)
            times[backend].append((clock.wall() - start) / calls * 1e6)
    us = {b: statistics.median(t) for b, t in times.items()}
    return {"rows": rows, "context": context, **{f"{b}_us": v for b, v in us.items()},
            "ratio": us["torch"] / us["cpu"], "drift": drift}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--context", default="96,1000,4000")
    ap.add_argument("--shape", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from services.shard import cpu_kernels

    machine.shard_threads()
    if not cpu_kernels.load():
        raise SystemExit(f"the CPU kernels did not build: {cpu_kernels.reason()}")
    out = []
    if not args.json:
        print(machine.line(), end="\n\n")
        print(
            "| shape | rows | context | torch µs | cpu µs | torch / cpu |\n|---|---:|---:|---:|---:|---:|", flush=True
        )
    for name in args.shape.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for context in (int(n) for n in args.context.split(",")):
                r = {"shape": name, **measure(rows, context, SHAPES[name], args.rounds)}
                out.append(r)
                if not args.json:
                    print(f"| {name} | {rows} | {context} | {r['torch_us']:.0f} | {r['cpu_us']:.0f} | "
                          f"{r['ratio']:.2f}× |", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
