"""The shard's token choice (services/shard/sampling/sampler.py `choose`) on large vocabularies: now against an earlier
version of the same file, and against plain torch, interleaved in one process so that load on the machine hits all
alike.

Per vocabulary × dtype × batch kind × rows it prints the median ms (or the least, --stat min) of
- torch: `argmax` + `log_softmax` + gather over the whole batch (what a straightforward step does);
- before: `choose` as the file was at --before (a git revision, read with `git show`; skipped with --before '');
- now: `choose` as it is in the working tree;

and before/now. Each pair is checked on the way: the same tokens, and the largest logprob difference is printed
(float32 rounding of the logsumexp, ~1e-5 at most).

Batch kinds: `greedy` (nothing asked: argmax and its logprob), `top-n` (greedy with 5 alternatives), `mixed` (every
fourth row a seeded draw at temperature 0.7, every fourth one past it greedy with 3 alternatives, the rest greedy),
`sampled` (every row a seeded draw at temperature 0.7: the per-row multinomial dominates).

    python -m launcher.bench.sampling [--vocab 128256,262144] [--rows 1,16,64] [--dtype bfloat16,float32]
        [--kinds greedy,top-n,mixed,sampled] [--reps 15] [--stat median|min] [--before 290be34]
        [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from libs.protocol.params import SamplingParams
from services.shard.sampling import sampler as now_sampling

KINDS = ("greedy", "top-n", "mixed", "sampled")
# the last commit before the chunked softmax reduction; its `choose` had the chunked greedy path already
DEFAULT_BEFORE = "290be34"


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


def load_before(rev: str):
    """services/shard/sampling/sampler.py as it was at `rev`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:services/shard/sampling/sampler.py"], capture_output=True, text=True, check=True
    ).stdout
    # imported from a file of its own, as any module (the project's code runs no exec/eval: tests/e2e/test_security.py)
    path = Path(tempfile.mkdtemp(prefix="sampling-before-")) / f"sampling_at_{rev.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_torch(logits: torch.Tensor, params, generators) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.argmax(logits, dim=-1)
    return ids, torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, None])[:, 0]


def _seeded(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]


def measure_case(
    ways: dict, logits: torch.Tensor, params: list[SamplingParams], reps: int, stat=statistics.median
) -> dict:
    """`stat` (median) ms per way, interleaved call by call; every `choose`'s tokens checked against the others'."""
    results = {}
    for name, fn in ways.items():  # warm-up, and the check
        if name == "torch":
            fn(logits, params, _seeded(params))
            continue
        results[name] = fn(logits, params, _seeded(params))
    ids = [c.token_ids for c in results.values()]
    if any(not torch.equal(ids[0], other) for other in ids[1:]):
        raise AssertionError(f"the versions chose different tokens: {[i.tolist()[:8] for i in ids]}")
    lps = [c.logprobs for c in results.values()]
    drift = max((float((lps[0] - other).abs().nan_to_num(0).max()) for other in lps[1:]), default=0.0)
    times = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            gens = _seeded(params)
            t = time.perf_counter()
            fn(logits, params, gens)
            times[name].append(time.perf_counter() - t)
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
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="git revision to compare with ('' for none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--stat", choices=("median", "min"), default="median", help="min: the least disturbed call, on a busy machine"
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    ways = {"torch": plain_torch}
    if args.before:
        ways["before"] = load_before(args.before).choose
    ways["now"] = now_sampling.choose
    kinds = args.kinds.split(",")
    for kind in kinds:
        batch_params(kind, 1)  # unknown names fail before any timing

    rows_out = []
    header = f"{'vocab':>7} {'dtype':>8} {'kind':>7} {'rows':>4} " + " ".join(f"{w + ' ms':>10}" for w in ways)
    if "before" in ways:
        header += f" {'before/now':>10}"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.stat} of {args.reps} calls,",
        f"before = {args.before or '-'}",
    )
    print(header + f" {'lp drift':>9}")
    gen = torch.Generator().manual_seed(0)
    for vocab in (int(v) for v in args.vocab.split(",")):
        for dtype_name in args.dtype.split(","):
            dtype = getattr(torch, dtype_name)
            for kind in kinds:
                for rows in (int(r) for r in args.rows.split(",")):
                    logits = (torch.randn(rows, vocab, generator=gen) * 2.0).to(dtype)
                    got = measure_case(
                        ways,
                        logits,
                        batch_params(kind, rows),
                        args.reps,
                        getattr(statistics, args.stat) if args.stat == "median" else min,
                    )
                    row = {"vocab": vocab, "dtype": dtype_name, "kind": kind, "rows": rows, **got}
                    line = f"{vocab:>7} {dtype_name:>8} {kind:>7} {rows:>4} "
                    line += " ".join(f"{got[w]:>10.2f}" for w in ways)
                    if "before" in ways:
                        row["before_over_now"] = got["before"] / got["now"]
                        line += f" {row['before_over_now']:>9.2f}x"
                    print(line + f" {got['logprob_drift']:>9.1e}", flush=True)
                    rows_out.append(row)
    if args.json:
        print(json.dumps(rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
