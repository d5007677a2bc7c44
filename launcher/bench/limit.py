"""The limit: our own shard model runner in one process, in a tight loop, no bus and no HTTP.

For a batch of `batch` prompts of `prompt_tokens` tokens, it does the work a server does for that many
concurrent requests of `output_tokens` new tokens: the prefills (packed up to `max_prefill_tokens` a step, as
the scheduler packs them), then `output_tokens - 1` decode steps of the whole batch. Output tokens per second
of that loop is the most this machine gives with our model code for that shape; end-to-end figures are
reported as a fraction of it. The decode step time is also the yardstick of the per-step overhead.

    python -m launcher.bench.limit --model DIR --batch 16 --prompt-tokens 64 --output-tokens 32   # prints JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

BLOCK = 16


def measure(
    model_dir: str,
    batch: int,
    prompt_tokens: int,
    output_tokens: int,
    *,
    dtype: str = "float32",
    max_prefill_tokens: int = 4096,
    seed: int = 0,
) -> dict:
    import torch

    from libs.protocol.messages import NewSequence, StepPlan
    from libs.protocol.params import SamplingParams
    from services.shard.model_runner import ModelRunner

    per_seq = -(-(prompt_tokens + output_tokens) // BLOCK)
    runner = ModelRunner(model_dir, num_blocks=batch * per_seq + per_seq, dtype=getattr(torch, dtype))
    vocab = runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(seed)
    step = 0

    def plan(rows, new=(), blocks=None, finished=()):
        nonlocal step
        step += 1
        seqs, nums, ctx, ids = zip(*rows)
        return StepPlan(
            step=step,
            new=list(new),
            blocks=blocks or {},
            finished=list(finished),
            seqs=np.asarray(seqs, np.int32),
            num_tokens=np.asarray(nums, np.int32),
            context_lens=np.asarray(ctx, np.int32),
            token_ids=np.concatenate(ids).astype(np.int32),
            sample=np.ones(len(rows), np.uint8),
        )

    # warm-up (first-call allocations, thread pools) on a sequence of its own, in the spare blocks
    warm = batch
    runner.execute(
        plan(
            [(warm, 8, 0, rng.integers(3, vocab, 8))],
            new=[NewSequence(warm, SamplingParams())],
            blocks={warm: list(range(batch * per_seq, batch * per_seq + per_seq))},
        )
    )
    runner.execute(plan([(warm, 1, 8, np.array([5]))], finished=[warm]))

    prompts = [rng.integers(3, vocab, prompt_tokens) for _ in range(batch)]
    t0 = time.perf_counter()
    last = {}
    pending = list(range(batch))
    while pending:  # prefills, packed up to the prefill budget (at least one row a step)
        take, used = [], 0
        while pending and (not take or used + prompt_tokens <= max_prefill_tokens):
            take.append(pending.pop(0))
            used += prompt_tokens
        res = runner.execute(
            plan(
                [(i, prompt_tokens, 0, prompts[i]) for i in take],
                new=[NewSequence(i, SamplingParams()) for i in take],
                blocks={i: list(range(i * per_seq, (i + 1) * per_seq)) for i in take},
            )
        )
        last.update(zip(res.seqs.tolist(), res.token_ids.tolist()))
    prefill_s = time.perf_counter() - t0
    steps = []
    for k in range(output_tokens - 1):
        t1 = time.perf_counter()
        rows = [(i, 1, prompt_tokens + k, np.array([last[i]])) for i in range(batch)]
        res = runner.execute(plan(rows, finished=range(batch) if k == output_tokens - 2 else ()))
        last = dict(zip(res.seqs.tolist(), res.token_ids.tolist()))
        steps.append(time.perf_counter() - t1)
    total = time.perf_counter() - t0
    step_s = statistics.median(steps) if steps else 0.0
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "threads": torch.get_num_threads(),
        "prefill_s": prefill_s,
        "decode_step_ms": step_s * 1000,
        "decode_step_ms_all": [s * 1000 for s in steps],
        "total_s": total,
        "tok_s": batch * output_tokens / total,  # the limit for this shape: prefill + decode, as a server does
        "decode_tok_s": batch / step_s if step_s else 0.0,  # decode-only rate at this batch size
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt-tokens", type=int, required=True)
    ap.add_argument("--output-tokens", type=int, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    import torch

    # the same thread count the shard process uses
    torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", os.cpu_count() or 1)))
    out = measure(
        args.model,
        args.batch,
        args.prompt_tokens,
        args.output_tokens,
        dtype=args.dtype,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
