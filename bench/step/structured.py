"""The structured workload's in-process half: decode steps with every row constrained by a JSON schema against the
same steps unconstrained, the model driven through the in-process engine (bench/engine.py: no bus, no HTTP), so the
ratio is the masks' cost alone; and where the constrained step's extra time goes (`apply`: wait for the masks
filled ahead, write them into the scores; `advance`: the matchers take the sampled tokens and the next masks start
filling). The constrained steps run both ways the shard can fill the masks: ahead on a worker beside the forward
pass (the default) and inline on the step's path with every core (SWITCHYARD_GRAMMAR_FILL=inline). `--choice-only`:
the token choice alone on random logits, no model. The model folder must name its EOS ids (a grammar ends on them).

    python -m bench.step.structured --model DIR --batch 16 --steps 32   # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from bench import clock, machine
from libs.runtime import cpu

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


def measure(
    model_dir: str,
    batch: int,
    steps: int,
    prompt_tokens: int = 64,
    dtype: str = "float32",
    rounds: int = 2,
    inline: bool = True,
):
    import torch

    from bench.engine import Engine, request
    from services.scheduler.batcher import Batcher
    from services.shard.model_runner import ModelRunner
    from services.tokenizer.grammar import json_grammar

    grammar = json_grammar(SCHEMA)
    num_blocks = batch * -(-(prompt_tokens + steps + 2) // BLOCK) + 2
    runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=BLOCK, dtype=getattr(torch, dtype))
    vocab = runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, prompt_tokens) for _ in range(batch)]

    def one_run(constrained: bool, ahead: bool = True) -> dict:
        runner.grammars.constraints.set_fill(ahead, None if ahead else cpu.summary()["cores"])
        runner.reset()  # a fresh Batcher below: the runner forgets the last run's sequences, as for a new scheduler
        # no EOS: every row runs all `steps` steps, through whatever the grammar allows
        b = Batcher(num_blocks, max_batch_size=batch, max_batch_prefill_tokens=max(4096, batch * prompt_tokens),
                    eos_ids=set(), prefix_caching=False, block_size=BLOCK)  # fmt: skip
        engine = Engine(runner, b, wire=False)
        for i, prompt in enumerate(prompts):
            engine.add(request(f"r{i}", prompt, steps + 1, grammar=grammar if constrained else ""))
        engine.step()  # every prompt in one step
        errors = []
        engine.on_step = lambda plan, result: errors.append(len(result.errors))
        cons = runner.grammars.constraints
        runner.timings = {}  # the choice: grammar mask, reduction, draws (every run has one)
        before = dict(cons.seconds)  # the matchers' own running totals: apply (the masks), advance
        times = []
        with clock.Lap() as run:  # CPU of all threads: torch's, the mask worker's (a busy machine stretches wall time)
            for _ in range(steps):  # a fixed count: a row the grammar failed stays in the batch, as in the runner
                with clock.Lap() as lap:
                    engine.step()
                times.append(lap.wall)
        sample_s, runner.timings = runner.timings.get("sampling", 0.0), None
        apply_s = cons.seconds["apply"] - before["apply"] if constrained else 0.0
        advance_s = cons.seconds["advance"] - before["advance"] if constrained else 0.0
        return {
            "step_ms": clock.p50_ms(times),
            "total_s": sum(times),
            "cpu_s": run.cpu,
            "sample_ms_per_step": sample_s / steps * 1000,
            "apply_ms_per_step": apply_s / steps * 1000,
            "advance_ms_per_step": advance_s / steps * 1000,
            "row_errors": sum(errors),
        }

    # the grammar side is built on a thread when the runner starts: wait for it outside the measured steps
    runner.grammars.open(-1, grammar, [])
    runner.grammars.discard(-1)
    one_run(False)  # warm-up: first-use allocations and kernels
    one_run(True)
    runs = []
    for _ in range(rounds):  # alternated, so a change of machine load hits every side
        free, con = one_run(False), one_run(True)
        run = {
            "unconstrained": free,
            "constrained": con,
            "ratio": free["total_s"] / con["total_s"],
            "ratio_cpu": free["cpu_s"] / con["cpu_s"],  # CPU seconds: steadier than wall time on a busy machine
        }
        if inline:
            run["inline"] = one_run(True, ahead=False)
            run["ratio_inline"] = free["total_s"] / run["inline"]["total_s"]
        runs.append(run)
    return {
        "model_dir": model_dir,
        "batch": batch,
        "steps": steps,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "vocab": vocab,
        "ratio": statistics.median(r["ratio"] for r in runs),
        "ratio_cpu": statistics.median(r["ratio_cpu"] for r in runs),
        # SWITCHYARD_GRAMMAR_FILL=inline
        "ratio_inline": statistics.median(r["ratio_inline"] for r in runs) if inline else None,
        "runs": runs,
    }


def measure_choice(model_dir: str, batch: int, steps: int, dtype: str = "bfloat16", rounds: int = 2) -> dict:
    """The choice alone (sampling.choose on random [batch, vocab] logits, greedy rows), every row under the JSON
    schema against none, with the served tokenizer's grammar side and no model: CPU seconds of the process (the
    mask worker's too) and of the calling thread (the step's path), per step. No forward pass, so torch's threads
    do not spin beside it and a busy machine moves the figures less than wall time."""
    import torch

    from libs.protocol.params import SamplingParams
    from libs.runtime import model_store
    from services.shard.grammar.runner import ShardGrammars
    from services.shard.sampling.sampler import choose
    from services.tokenizer.grammar import json_grammar

    grammar = json_grammar(SCHEMA)
    eos_ids = list(model_store.model_info(model_dir)["eos_token_ids"])  # as the runner reads them
    grammars = ShardGrammars(model_dir, eos_ids)
    grammars.open(-1, grammar, [])
    grammars.discard(-1)
    vocab = grammars.constraints.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = [(torch.randn(batch, vocab, generator=gen) * 3).to(getattr(torch, dtype)) for _ in range(steps)]
    params = [SamplingParams()] * batch

    def one_run(constrained: bool) -> dict:
        seqs = list(range(batch))
        if constrained:
            for s in seqs:
                grammars.open(s, grammar, [])
        cpu, path = 0.0, 0.0
        for k in range(steps):
            step_logits = logits[k].clone()
            p0, t0 = clock.cpu(), clock.thread_cpu()
            keys = grammars.keys(seqs)
            errors: dict[int, str] = {}
            constrain = None if keys is None else grammars.mask(keys, errors)
            choice = choose(step_logits, params, [None] * batch, constrain=constrain)
            if keys is not None:
                grammars.advance(keys, choice.token_ids.tolist(), errors)
            path += clock.thread_cpu() - t0
            cpu += clock.cpu() - p0
            for s, t in zip(seqs, choice.token_ids.tolist()):
                if keys is not None and (t in eos_ids or s in errors):  # a row that ended starts a new answer:
                    grammars.discard(s)  # every row stays constrained, as in the runner's unbounded-array steps
                    grammars.open(s, grammar, [])
        for s in seqs:
            grammars.discard(s)
        return {"cpu_ms_per_step": cpu / steps * 1000, "path_ms_per_step": path / steps * 1000}

    one_run(False)
    one_run(True)
    runs = []
    for _ in range(rounds):
        free, con = one_run(False), one_run(True)
        runs.append(
            {
                "unconstrained": free,
                "constrained": con,
                "extra_cpu_ms": con["cpu_ms_per_step"] - free["cpu_ms_per_step"],
            }
        )
    return {"model_dir": model_dir, "batch": batch, "steps": steps, "dtype": dtype, "vocab": vocab,
            "threads": torch.get_num_threads(), "stats": dict(grammars.constraints.stats), "runs": runs}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-inline", action="store_true", help="skip the masks-filled-inline side")
    ap.add_argument("--choice-only", action="store_true", help="time sampling.choose alone (no model)")
    args = ap.parse_args(argv)
    machine.shard_threads()  # as the shard
    if args.choice_only:
        out = measure_choice(args.model, args.batch, args.steps, dtype=args.dtype, rounds=args.rounds)
        json.dump(out, sys.stdout)
        print()
        return 0
    out = measure(args.model, args.batch, args.steps, dtype=args.dtype, rounds=args.rounds, inline=not args.no_inline)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
