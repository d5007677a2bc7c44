"""The limit: the model through the in-process engine (bench/engine.py: the scheduler's Batcher and the shard's
ModelRunner in one loop, no bus, no HTTP), as fast as this machine runs it.

For `--batch` requests of `--prompt-tokens` random tokens and `--output-tokens` new tokens each, the Batcher plans
what a server's scheduler would: the prefills packed up to `--max-prefill-tokens` a step, then decode steps of the
whole batch. Output tokens per second of that loop is the most this machine gives with our model code for that
shape (end-to-end figures are reported as a fraction of it). The decode step (each step once every prompt is
prefilled: plan, execute, apply) is the yardstick of the per-step overhead; its CPU time compares on a busy machine.

    python -m bench.step.limit --model DIR --batch 16 --prompt-tokens 64 --output-tokens 32   # prints JSON
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench import clock, machine


class Batch:
    """`batch` requests of `prompt_tokens` random tokens and `output_tokens` new tokens each, through an Engine over a
    ModelRunner sized for them (and for `spare_tokens` more: the warm-up, a request joining mid-flight). The Batcher
    plans as a server's does, with no EOS (every request runs to its length) and no prefix cache (random prompts)."""

    def __init__(
        self,
        model_dir: str,
        batch: int,
        prompt_tokens: int,
        output_tokens: int,
        *,
        dtype: str = "float32",
        max_prefill_tokens: int = 4096,
        spare_tokens: int = 16,
        seed: int = 0,
        **runner_kwargs,  # more ModelRunner arguments (onednn_linear=False: torch's own linears; quantize=...)
    ):
        import torch

        from bench.engine import Engine
        from services.scheduler.batcher import Batcher
        from services.shard.model_runner import ModelRunner

        self.batch, self.prompt_tokens, self.output_tokens = batch, prompt_tokens, output_tokens
        block = runner_kwargs.pop("block_size", 16)
        blocks = batch * -(-(prompt_tokens + output_tokens) // block) + -(-(spare_tokens + 2) // block)
        blocks += blocks // 100 + 2  # the Batcher keeps a watermark free at admission
        self.runner = ModelRunner(
            model_dir, num_blocks=blocks, block_size=block, dtype=getattr(torch, dtype), **runner_kwargs
        )
        batcher = Batcher(blocks, max_batch_size=batch + 1, max_batch_prefill_tokens=max_prefill_tokens, eos_ids=set(),
                          prefix_caching=False, block_size=block)  # fmt: skip
        self.engine = Engine(self.runner, batcher, wire=False)
        self.vocab = self.runner.model.config.get_text_config().vocab_size
        self.rng = np.random.default_rng(seed)

    def prompt(self, n: int) -> np.ndarray:
        return self.rng.integers(3, self.vocab, n)

    def warm(self) -> None:
        """First-call allocations and thread pools: one short request, prefill and a decode, before the batch."""
        from bench.engine import request

        self.engine.add(request("warm", self.prompt(8), 2))
        self.engine.run()

    def start(self) -> None:
        """The batch's requests, waiting for the next step."""
        from bench.engine import request

        for i in range(self.batch):
            self.engine.add(request(f"r{i}", self.prompt(self.prompt_tokens), self.output_tokens))

    def prefilled(self) -> bool:
        """Whether every request of the batch has its first token (its prompt is in the KV cache)."""
        return all(self.engine.outputs[f"r{i}"].tokens for i in range(self.batch))

    def prefill(self) -> None:
        """Steps until every prompt is prefilled (decodes of the first prompts ride along, as in a server)."""
        while not self.prefilled():
            if self.engine.step() is None:
                raise RuntimeError("the batch's prompts do not fit the KV cache")

    def has_work(self) -> bool:
        return self.engine.batcher.has_work()


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

    b = Batch(model_dir, batch, prompt_tokens, output_tokens, dtype=dtype, max_prefill_tokens=max_prefill_tokens,
              seed=seed)  # fmt: skip
    b.warm()
    b.start()
    t0 = clock.wall()
    b.prefill()
    prefill_s = clock.wall() - t0
    steps, cpu = [], []
    while b.has_work():
        with clock.Lap() as lap:
            b.engine.step()
        steps.append(lap.wall)
        cpu.append(lap.cpu)
    total = clock.wall() - t0
    step_ms = clock.p50_ms(steps)
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "threads": torch.get_num_threads(),
        "prefill_s": prefill_s,
        "decode_step_ms": step_ms,
        "decode_step_ms_all": [s * 1000 for s in steps],
        # CPU time of the process (all its threads) per decode step: comparable on a busy machine, and with the
        # shard's CPU per step end to end (bench/serving/pipeline.py)
        "decode_step_cpu_ms": clock.p50_ms(cpu),
        "total_s": total,
        "tok_s": batch * output_tokens / total,  # the limit for this shape: prefill + decode, as a server does
        "decode_tok_s": 1000 * batch / step_ms if step_ms else 0.0,  # decode-only rate at this batch size
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
    machine.shard_threads()  # the same thread count the shard process uses
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
