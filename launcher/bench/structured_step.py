"""The structured workload's in-process half: the shard's ModelRunner decode step with every row constrained by a
JSON schema against the same step unconstrained, in one process (no bus, no HTTP), so the ratio is the masks'
cost alone; and where the constrained step's extra time goes (`apply`: wait for the masks filled ahead, write
them into the scores; `advance`: the matchers take the sampled tokens and the next masks start filling). The
constrained step is measured both ways the shard can fill the masks: ahead on a worker beside the forward pass
(the default) and inline on the step's path with every core (SWITCHYARD_GRAMMAR_FILL=inline).

    python -m launcher.bench.structured_step --model DIR --batch 16 --steps 32   # prints JSON

The model folder must name its EOS ids (the grammar ends on them): not the bench's no-EOS views.
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
# A list of objects with no bound on its length: the rows keep going for any number of steps, through strings,
# numbers and punctuation, as a long structured answer does.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "score": {"type": "number"},
        },
        "required": ["name", "tags", "score"],
    },
}


class _Timed:
    """Wall seconds spent in one method of an object, summed (the runner itself carries no timers)."""

    def __init__(self, obj, name: str):
        self.seconds = 0.0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)


def measure(model_dir: str, batch: int, steps: int, prompt_tokens: int = 64, dtype: str = "float32", rounds: int = 2):
    import torch

    from libs.protocol.messages import NewSequence, StepPlan
    from libs.protocol.params import SamplingParams
    from services.shard.model_runner import ModelRunner
    from services.tokenizer.grammar import json_grammar

    grammar = json_grammar(SCHEMA)
    per_seq = -(-(prompt_tokens + steps + 1) // BLOCK)
    runner = ModelRunner(model_dir, num_blocks=batch * per_seq, dtype=getattr(torch, dtype))
    vocab = runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, prompt_tokens) for _ in range(batch)]
    step_no = 0

    def plan(rows, new=(), blocks=None, finished=()):
        nonlocal step_no
        step_no += 1
        seqs, nums, ctx, ids = zip(*rows)
        return StepPlan(step=step_no, new=list(new), blocks=blocks or {}, finished=list(finished),
                        seqs=np.asarray(seqs, np.int32), num_tokens=np.asarray(nums, np.int32),
                        context_lens=np.asarray(ctx, np.int32), token_ids=np.concatenate(ids).astype(np.int32),
                        sample=np.ones(len(rows), np.uint8))  # fmt: skip

    def one_run(constrained: bool, ahead: bool = True) -> dict:
        runner.grammars.constraints.set_fill(ahead, None if ahead else os.cpu_count())
        seqs = list(range(batch))
        new = [NewSequence(s, SamplingParams(), grammar=grammar if constrained else "") for s in seqs]
        blocks = {s: list(range(s * per_seq, (s + 1) * per_seq)) for s in seqs}
        res = runner.execute(plan([(s, prompt_tokens, 0, prompts[s]) for s in seqs], new=new, blocks=blocks))
        last = dict(zip(res.seqs.tolist(), res.token_ids.tolist()))
        cons = runner.grammars.constraints
        apply = _Timed(cons, "apply") if constrained else None
        advance = _Timed(cons, "advance") if constrained else None
        times, errors = [], 0
        for k in range(steps):
            t0 = time.perf_counter()
            rows = [(s, 1, prompt_tokens + k, np.array([last[s]])) for s in seqs]
            res = runner.execute(plan(rows, finished=seqs if k == steps - 1 else ()))
            times.append(time.perf_counter() - t0)
            last = dict(zip(res.seqs.tolist(), res.token_ids.tolist()))
            errors += len(res.errors)
        if constrained:  # the instance's wrappers go: the class's methods show through again
            del cons.apply, cons.advance
        return {
            "step_ms": statistics.median(times) * 1000,
            "total_s": sum(times),
            "apply_ms_per_step": apply.seconds / steps * 1000 if apply else 0.0,
            "advance_ms_per_step": advance.seconds / steps * 1000 if advance else 0.0,
            "row_errors": errors,
        }

    # the grammar side is built on a thread when the runner starts: wait for it outside the measured steps
    runner.grammars.open(-1, grammar, [])
    runner.grammars.discard(-1)
    one_run(False)  # warm-up: first-use allocations and kernels
    one_run(True)
    runs = []
    for _ in range(rounds):  # alternated, so a change of machine load hits every side
        free, con, inline = one_run(False), one_run(True), one_run(True, ahead=False)
        ratios = {"ratio": free["total_s"] / con["total_s"], "ratio_inline": free["total_s"] / inline["total_s"]}
        runs.append({"unconstrained": free, "constrained": con, "inline": inline, **ratios})
    return {
        "model_dir": model_dir,
        "batch": batch,
        "steps": steps,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "vocab": vocab,
        "ratio": statistics.median(r["ratio"] for r in runs),
        "ratio_inline": statistics.median(r["ratio_inline"] for r in runs),  # SWITCHYARD_GRAMMAR_FILL=inline
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", os.cpu_count() or 1)))  # as the shard
    out = measure(args.model, args.batch, args.steps, dtype=args.dtype, rounds=args.rounds)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
