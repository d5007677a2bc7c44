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


class Driver:
    """A ModelRunner and `batch` sequences of `prompt_tokens` random tokens, driven the way the scheduler drives
    it: warm-up, packed prefills, then decode steps of the whole batch (shared by the limit and the profile)."""

    def __init__(
        self,
        model_dir: str,
        batch: int,
        prompt_tokens: int,
        output_tokens: int,
        *,
        dtype: str = "float32",
        seed: int = 0,
        **runner_kwargs,  # more ModelRunner arguments (onednn_linear=False: torch's own linears)
    ):
        import torch

        from services.shard.model_runner import ModelRunner

        self.batch, self.prompt_tokens, self.output_tokens = batch, prompt_tokens, output_tokens
        self.per_seq = -(-(prompt_tokens + output_tokens) // BLOCK)
        self.runner = ModelRunner(
            model_dir, num_blocks=(batch + 1) * self.per_seq, dtype=getattr(torch, dtype), **runner_kwargs
        )
        self.vocab = self.runner.model.config.get_text_config().vocab_size
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.last: dict[int, int] = {}

    def plan(self, rows, new=(), blocks=None, finished=()):
        from libs.protocol.step_messages import StepPlan

        self.step += 1
        seqs, nums, ctx, ids = zip(*rows)
        return StepPlan(
            step=self.step,
            new=list(new),
            blocks=blocks or {},
            finished=list(finished),
            seqs=np.asarray(seqs, np.int32),
            num_tokens=np.asarray(nums, np.int32),
            context_lens=np.asarray(ctx, np.int32),
            token_ids=np.concatenate(ids).astype(np.int32),
            sample=np.ones(len(rows), np.uint8),
        )

    def _blocks(self, seq: int) -> list[int]:
        return list(range(seq * self.per_seq, (seq + 1) * self.per_seq))

    def warm(self) -> None:
        """First-call allocations and thread pools, on a sequence of its own in the spare blocks."""
        from libs.protocol.params import SamplingParams
        from libs.protocol.step_messages import NewSequence

        warm = self.batch
        new = [NewSequence(warm, SamplingParams())]
        self.runner.execute(
            self.plan([(warm, 8, 0, self.rng.integers(3, self.vocab, 8))], new, {warm: self._blocks(warm)})
        )
        self.runner.execute(self.plan([(warm, 1, 8, np.array([5]))], finished=[warm]))

    def prefill(self, max_prefill_tokens: int = 4096) -> None:
        """Every prompt, packed up to the prefill budget a step (at least one row a step), as the scheduler packs."""
        from libs.protocol.params import SamplingParams
        from libs.protocol.step_messages import NewSequence

        n = self.prompt_tokens
        prompts = [self.rng.integers(3, self.vocab, n) for _ in range(self.batch)]
        pending = list(range(self.batch))
        while pending:
            take, used = [], 0
            while pending and (not take or used + n <= max_prefill_tokens):
                take.append(pending.pop(0))
                used += n
            plan = self.plan(
                [(i, n, 0, prompts[i]) for i in take],
                new=[NewSequence(i, SamplingParams()) for i in take],
                blocks={i: self._blocks(i) for i in take},
            )
            res = self.runner.execute(plan)
            self.last.update(zip(res.seqs.tolist(), res.token_ids.tolist()))

    def _decode_rows(self, k: int) -> list:
        return [(i, 1, self.prompt_tokens + k, np.array([self.last[i]])) for i in range(self.batch)]

    def decode_plan(self, k: int):
        """The plan of decode step `k` (0-based) of the whole batch; the last one finishes every sequence."""
        return self.plan(self._decode_rows(k), finished=range(self.batch) if k == self.output_tokens - 2 else ())

    def joined_plan(self, k: int, tokens: int):
        """Decode step `k` of the whole batch with a fresh `tokens`-token prompt prefilled beside it, on the warm-up's
        sequence and blocks, dropped after the step (what a request joining mid-flight adds to a step)."""
        from libs.protocol.params import SamplingParams
        from libs.protocol.step_messages import NewSequence

        spare = self.batch
        rows = [*self._decode_rows(k), (spare, tokens, 0, self.rng.integers(3, self.vocab, tokens))]
        new = [NewSequence(spare, SamplingParams())]
        return self.plan(rows, new, {spare: self._blocks(spare)}, finished=[spare])

    def took(self, result) -> None:
        self.last = dict(zip(result.seqs.tolist(), result.token_ids.tolist()))


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

    driver = Driver(model_dir, batch, prompt_tokens, output_tokens, dtype=dtype, seed=seed)
    driver.warm()
    t0 = time.perf_counter()
    driver.prefill(max_prefill_tokens)
    prefill_s = time.perf_counter() - t0
    steps, cpu = [], []
    for k in range(output_tokens - 1):
        t1, c1 = time.perf_counter(), time.process_time()
        driver.took(driver.runner.execute(driver.decode_plan(k)))
        steps.append(time.perf_counter() - t1)
        cpu.append(time.process_time() - c1)
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
        # CPU time of the process (all its threads) per decode step: comparable on a busy machine, and with the
        # shard's CPU per step end to end (launcher.bench.pipeline)
        "decode_step_cpu_ms": statistics.median(cpu) * 1000 if cpu else 0.0,
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
