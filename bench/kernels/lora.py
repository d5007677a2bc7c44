"""The cost of LoRA adapters on one linear: the base product alone against the base plus the grouped apply
(services/shard/lora/registry.py) for rows spread over 4 adapters, the stacked form small steps take (every adapter
in one shrink, a mask, one expand), and a per-token gather of the weights (what a kernel that looks up each token's
adapter does, as vLLM's punica path).

Rows are laid out two ways: sorted (each adapter's rows side by side: slices, no gather) and interleaved (round
robin: index gathers and scatters). The base product is the one the shard serves with (oneDNN, prepacked) where
available. Every variant is timed interleaved with the others, rounds times, and the median kept, so load on the
machine hits all alike.

    python -m bench.kernels.lora [--rows 16,64] [--ranks 8,16] [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics

from bench import machine
from bench.clock import median_ms

SHAPES = {"SmolLM2-135M gate/up 576→1536": (576, 1536), "2048→8192": (2048, 8192)}
ADAPTERS = 4


def _variants(base, x, weights, a_stack, b_stack) -> dict:
    """The four ways to compute one step's product for these rows (closures over one shape's tensors)."""
    import torch

    from services.shard.lora.products import STACKED_MAX_TOKENS, Stack, expand, expand_stacked, group_rows, shrink

    m = x.shape[0]
    sorted_slots = [i * ADAPTERS // m for i in range(m)]
    mixed_slots = [i % ADAPTERS for i in range(m)]
    by_token = torch.tensor(mixed_slots)
    a_by_slot = {s: a for s, (a, _) in weights.items()}
    b_by_slot = {s: (0, a.shape[0], b.T.contiguous()) for s, (a, b) in weights.items()}

    def grouped(slots):
        groups = group_rows(slots)  # once per step in the shard; counted here once per product, an upper bound
        groups.token_slots = None  # the grouped form whatever the size
        return expand(base(x), groups, shrink(x, groups, a_by_slot), b_by_slot)

    slots = sorted(weights)
    ranks = [weights[s][0].shape[0] for s in slots]
    column_slots = [s for s, r in zip(slots, ranks) for _ in range(r)]
    stack = Stack(tuple(column_slots), torch.cat([weights[s][0] for s in slots]), torch.tensor(column_slots))
    stack_b = (0, sum(ranks), torch.cat([weights[s][1] for s in slots], dim=1).T.contiguous())

    def stacked():
        groups = group_rows(mixed_slots)  # once per step in the shard, the mask once per layout: upper bounds
        return expand_stacked(base(x), stack.shrink(x, groups), stack_b)

    return {
        "base": lambda: base(x),
        "sorted": lambda: grouped(sorted_slots),
        "interleaved": lambda: grouped(mixed_slots),
        **({"stacked": stacked} if m <= STACKED_MAX_TOKENS else {}),
        "gather": gathered_fn(base, x, a_stack, b_stack, by_token),
    }


def gathered_fn(base, x, a_stack, b_stack, by_token):
    """A per-token gather of the weights (vLLM's punica path): each token's adapter's A and B looked up."""
    import torch

    def gathered():
        y = base(x)
        shrunk = torch.bmm(a_stack[by_token], x[:, :, None])  # per token: its adapter's A
        return y + torch.bmm(b_stack[by_token], shrunk)[:, :, 0]

    return gathered


def measure(rows_list: list[int], ranks: list[int], rounds: int = 5, reps: int = 5, dtype: str = "float32"):
    import torch

    dt = getattr(torch, dtype)
    tol = 1e-4 if dt == torch.float32 else 3e-2

    from services.shard.model import onednn

    gen = torch.Generator().manual_seed(0)
    results = []
    for label, (n_in, n_out) in SHAPES.items():
        weight = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dt)
        if onednn.available():
            packed = onednn.pack(weight)

            def base(x, packed=packed, n_out=n_out):
                return onednn.linear(x, packed, None, n_out)
        else:

            def base(x, weight=weight):
                return torch.nn.functional.linear(x, weight)

        for r in ranks:
            weights = {
                s: (
                    (torch.randn(r, n_in, generator=gen) * 0.02).to(dt),
                    (torch.randn(n_out, r, generator=gen) * 0.02).to(dt),
                )
                for s in range(ADAPTERS)
            }
            a_stack = torch.stack([weights[s][0] for s in range(ADAPTERS)])  # [adapters, r, in]
            b_stack = torch.stack([weights[s][1] for s in range(ADAPTERS)])  # [adapters, out, r]
            for m in rows_list:
                x = torch.randn(m, n_in, generator=gen).to(dt)
                variants = _variants(base, x, weights, a_stack, b_stack)
                with torch.inference_mode():
                    for fn in variants.values():  # warm up
                        fn()
                    # the same slots per row: grouped and per-token gather must agree
                    torch.testing.assert_close(variants["interleaved"](), variants["gather"](), atol=tol, rtol=tol)
                    if "stacked" in variants:
                        torch.testing.assert_close(variants["stacked"](), variants["gather"](), atol=tol, rtol=tol)
                    times: dict[str, list[float]] = {k: [] for k in variants}
                    for _ in range(rounds):
                        for k, fn in variants.items():
                            times[k].append(median_ms(fn, reps))
                med = {k: statistics.median(v) for k, v in times.items()}
                results.append({"shape": label, "rank": r, "rows": m, **med})
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| linear | r | rows | base ms | + grouped, sorted | + grouped, interleaved | + stacked, interleaved "
        "| per-token gather |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        base = row["base"]

        def cell(k, row=row, base=base):
            return f"{row[k]:.3f} (+{100 * (row[k] / base - 1):.0f}%)" if k in row else "–"

        lines.append(
            f"| {row['shape']} | {row['rank']} | {row['rows']} | {base:.3f} | {cell('sorted')} | "
            f"{cell('interleaved')} | {cell('stacked')} | {cell('gather')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64", help="rows per step (comma list)")
    parser.add_argument("--ranks", default="8,16", help="adapter ranks (comma list)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 (what the shard serves in)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5, help="calls per timing (median of rounds)")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(
        [int(v) for v in args.rows.split(",")],
        [int(v) for v in args.ranks.split(",")],
        args.rounds,
        args.reps,
        args.dtype,
    )
    print(f"{ADAPTERS} adapters, {args.dtype}; {machine.line()}")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
