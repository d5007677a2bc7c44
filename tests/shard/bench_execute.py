"""Micro-benchmark (a script, not a test): ModelRunner.execute for a decode batch at a given context length.

The KV cache is filled with random values instead of real prefills (a 64 x 256-token Gemma prefill would take
minutes on a small CPU); the decode step reads exactly as much KV as after real prefills, so the timing holds.

    .venv/bin/python -m tests.shard.bench_execute [--model DIR] [--batches 16,32,64] [--context 256]

With no --model: the default Gemma (if converted) and the tiny llama. Prints ms per step (median of --reps).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from libs.protocol.messages import NewSequence, StepPlan
from libs.protocol.params import SamplingParams
from services.shard.model_runner import ModelRunner
from tests.tiny_models import build_model

GEMMA = Path.home() / ".cache/switchyard/models/gemma-3-270m-q4km"


def bench(model_dir: str, batches: list[int], context: int, reps: int) -> dict[int, float]:
    bs = 16
    per_seq = -(-(context + reps + 2) // bs)
    runner = ModelRunner(model_dir, num_blocks=max(batches) * per_seq, block_size=bs)
    gen = torch.Generator().manual_seed(0)
    for k, v in zip(runner.k_cache, runner.v_cache):
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    out = {}
    for n in batches:
        runner.seqs.clear()
        blocks = np.random.default_rng(n).permutation(n * per_seq).reshape(n, per_seq)  # scattered pages
        new = [NewSequence(i, SamplingParams()) for i in range(n)]
        plan_blocks = {i: blocks[i].tolist() for i in range(n)}
        times = []
        for r in range(reps + 1):
            plan = StepPlan(
                step=r + 1,
                new=new if r == 0 else [],
                blocks=plan_blocks if r == 0 else {},
                seqs=np.arange(n, dtype=np.int32),
                num_tokens=np.ones(n, np.int32),
                context_lens=np.full(n, context + r, np.int32),
                token_ids=np.full(n, 5, np.int32),
                sample=np.ones(n, np.uint8),
            )
            t0 = time.perf_counter()
            runner.execute(plan)
            if r:  # the first step warms up
                times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append")
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.model
    if not models:
        models = [str(build_model(Path(tempfile.gettempdir()) / "switchyard-bench-llama", "llama"))]
        if GEMMA.exists():
            models.insert(0, str(GEMMA))
    batches = [int(b) for b in args.batches.split(",")]
    for m in models:
        res = bench(m, batches, args.context, args.reps)
        line = "  ".join(f"batch {n}: {ms:8.1f} ms" for n, ms in res.items())
        print(f"{Path(m).name:28s} context {args.context}: {line}", flush=True)


if __name__ == "__main__":
    main()
