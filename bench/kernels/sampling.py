"""The shard's token choice (services/shard/sampling/sampler.py `choose`) on large vocabularies, against plain torch,
interleaved in one process so that load on the machine hits both alike.

Per vocabulary × dtype × batch kind × rows it prints the median ms (or the least, --stat min) of `torch` (`argmax` +
`log_softmax` + gather over the whole batch), `stages` (`choose` by its torch stages) and `kernel` (`choose` by the
C++ kernel, sampling.cpp, where it builds: the shard takes it in half precision), checking that each took torch's token
on every greedy row (and printing the largest logprob difference there). Batch kinds: `greedy`, `top-n`
(greedy with 5 alternatives), `mixed` (greedy, seeded draws and alternatives by row), `sampled` (every row a
seeded draw at temperature 0.7).

    python -m bench.kernels.sampling [--vocab 128256,262144] [--rows 1,16,64] [--dtype bfloat16,float32]
        [--kinds greedy,top-n,mixed,sampled] [--reps 15] [--stat median|min] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import torch

from bench import clock, machine
from libs.protocol.params import SamplingParams
from services.shard import cpu_kernels
from services.shard.sampling import sampler

KINDS = ("greedy", "top-n", "mixed", "sampled")


def batch_params(kind: str, rows: int) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams()] * rows
    if kind == "top-n":
        return [SamplingParams(top_n_tokens=5)] * rows
    if kind == "sampled":
        return [SamplingParams(do_sample=True, temperature=0.7, seed=i) for i in range(rows)]
    if kind == "mixed":
        return [
            SamplingParams(do_sample=True, temperature=0.7, seed=i)
            if i % 4 == 0
            else SamplingParams(top_n_tokens=3)
            if i % 4 == 1
            else SamplingParams()
            for i in range(rows)
        ]
    raise ValueError(f"unknown batch kind {kind!r}: one of {', '.join(KINDS)}")


def plain_torch(logits: torch.Tensor, params, generators) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.argmax(logits, dim=-1)
    return ids, torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, None])[:, 0]


def _seeded(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]


def measure_case(
    ways: dict, logits: torch.Tensor, params: list[SamplingParams], reps: int, stat=statistics.median
) -> dict:
    """`stat` ms per way, interleaved call by call; the other ways' greedy rows checked against `torch`'s."""
    ids, lps = plain_torch(logits, params, _seeded(params))
    greedy = torch.tensor([not p.samples() for p in params])
    drift = 0.0
    for name, fn in ways.items():
        if name == "torch":
            continue
        choice = fn(logits, params, _seeded(params))
        if not torch.equal(choice.token_ids[greedy], ids[greedy]):
            raise AssertionError(f"{name} took other tokens than argmax: {choice.token_ids[greedy].tolist()[:8]}")
        if greedy.any():
            drift = max(drift, float((choice.logprobs[greedy] - lps[greedy]).abs().nan_to_num(0).max()))
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            gens = _seeded(params)
            times[name] += clock.times(lambda fn=fn, gens=gens: fn(logits, params, gens), 1)
    out = {name: stat(ts) * 1000 for name, ts in times.items()}
    out["logprob_drift"] = drift
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="128256,262144")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--kinds", default="greedy,top-n,mixed,sampled")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--stat", choices=("median", "min"), default="median", help="min: the least disturbed call, on a busy machine"
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    ways = {"torch": plain_torch, "stages": sampler.choose}
    if cpu_kernels.load():
        ways["kernel"] = functools.partial(sampler.choose, kernels=True)
    kinds = args.kinds.split(",")
    for kind in kinds:
        batch_params(kind, 1)  # unknown names fail before any timing

    rows_out = []
    print(f"{machine.line()}; {args.stat} of {args.reps} calls")
    print(f"{'vocab':>7} {'dtype':>8} {'kind':>7} {'rows':>4} " + " ".join(f"{w + ' ms':>10}" for w in ways)
          + f" {'lp drift':>9}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for vocab in (int(v) for v in args.vocab.split(",")):
        for dtype_name in args.dtype.split(","):
            dtype = getattr(torch, dtype_name)
            for kind in kinds:
                for rows in (int(r) for r in args.rows.split(",")):
                    logits = (torch.randn(rows, vocab, generator=gen) * 2.0).to(dtype)
                    stat = statistics.median if args.stat == "median" else min
                    got = measure_case(ways, logits, batch_params(kind, rows), args.reps, stat)
                    row = {"vocab": vocab, "dtype": dtype_name, "kind": kind, "rows": rows, **got}
                    line = f"{vocab:>7} {dtype_name:>8} {kind:>7} {rows:>4} "
                    line += " ".join(f"{got[w]:>10.2f}" for w in ways)
                    print(line + f" {got['logprob_drift']:>9.1e}", flush=True)
                    rows_out.append(row)
    if args.json:
        print(json.dumps(rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
