"""Where a decode step's time goes: the model driven through the in-process engine (as bench/step/limit.py drives
it), the shard's part of each decode step timed piece by piece (the runner's part timings and module hooks).

The parts of one decode step of the whole batch, each the median over the steps once every prompt is prefilled:
wire in, prepare (the rows laid out), layers, LM head, forward other, sampling, pack (the result's arrays),
execute other, publish (the result's frames). --compare: three runners' whole decode steps interleaved (bf16 with
the oneDNN linears, bf16 with torch's, float32 with oneDNN); --compare-walk: the direct decoder walk against
transformers' forward; --compare-kernels: the C++ kernels (services/shard/cpu_kernels/) against torch's ops;
--join-tokens N: a decode step alone against one with an N-token prompt joining it.

    python -m bench.step.profile --model llama-128k,smollm2,gemma --batch 1,16,64 [--dtype auto] [--compare]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from bench import clock, machine
from bench.step.limit import Batch

PARTS = ("wire in", "prepare", "layers", "LM head", "forward other", "sampling", "pack", "execute other", "publish")


class StepTimers:
    """Per-step seconds of the named parts: the runner's own part timings (`ModelRunner.timings`), forward hooks on
    its modules (torch's public hooks), and the step's whole `execute` time (`StepResult.forward_s`)."""

    def __init__(self, runner):
        self.runner = runner
        runner.timings = {}
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        model = runner.model
        self.walk = runner.walk is not None
        if not self.walk:  # transformers' forward calls the model's body; the walk's layers are the rest of it
            self._hook(model.model, "layers")
        self._hook(model.get_output_embeddings(), "LM head")

    def _hook(self, module, part):
        started = []
        module.register_forward_pre_hook(lambda *_: started.append(clock.wall()))

        def done(*_):
            self.now[part] += clock.wall() - started.pop()

        module.register_forward_hook(done)

    def close_step(self, execute: float, **measured: float) -> float:
        """Files the step's parts (`execute`: the runner's whole call; `measured`: those timed outside the runner);
        its whole time, wire included."""
        step = dict(self.now)
        step.update(self.runner.timings)
        step.update(measured)
        if self.walk:  # the walk's forward: the layers (with the embedding and final norm), then the LM head
            step["layers"] = step.get("forward", 0.0) - step.get("LM head", 0.0)
        total = step.get("wire in", 0.0) + execute + step.get("publish", 0.0)
        step["forward other"] = step.pop("forward", 0.0) - step.get("layers", 0.0) - step.get("LM head", 0.0)
        inner = sum(step.get(p, 0.0) for p in ("prepare", "layers", "LM head", "forward other", "sampling", "pack"))
        step["execute other"] = execute - inner
        self.steps.append(step)
        self.now.clear()
        self.runner.timings.clear()
        return total

    def medians_ms(self) -> dict[str, float]:
        return {p: clock.p50_ms(s.get(p, 0.0) for s in self.steps) for p in PARTS}


def profile(
    model_dir: str,
    batch: int,
    prompt_tokens: int,
    output_tokens: int,
    dtype: str,
    onednn: bool = True,
    walk: bool = True,
) -> dict:
    from libs.protocol import codec

    b = Batch(model_dir, batch, prompt_tokens, output_tokens, dtype=dtype, onednn_linear=onednn, decoder_walk=walk)
    b.warm()
    b.start()
    b.prefill()
    timers = StepTimers(b.runner)
    wire: dict[str, float] = {}

    def on_wire(plan, result) -> None:  # what the shard adds around `execute`: the plan's frames in, the result's out
        frames = [bytes(f) for f in codec.encode(plan)]
        t0 = clock.wall()
        codec.decode(frames)
        t1 = clock.wall()
        codec.encode(result)
        wire.update({"wire in": t1 - t0, "publish": clock.wall() - t1, "execute": result.forward_s})

    b.engine.on_step = on_wire
    totals = []
    while b.has_work():
        b.engine.step()
        totals.append(timers.close_step(**wire))
    return {
        "batch": batch,
        "dtype": dtype,
        "forward": "walk" if b.runner.walk is not None else "transformers",
        "step_ms": clock.p50_ms(totals),
        "parts_ms": timers.medians_ms(),
    }


COMPARED = {
    "bf16, oneDNN linears": dict(dtype="bfloat16"),
    "bf16, torch's linears": dict(dtype="bfloat16", onednn_linear=False),
    "fp32, oneDNN linears": dict(dtype="float32"),
}


def walk_compared(dtype: str) -> dict[str, dict]:
    """--compare-walk: the direct decoder walk against transformers' forward, at one dtype."""
    return {"decoder walk": dict(dtype=dtype), "transformers' forward": dict(dtype=dtype, decoder_walk=False)}


def kernels_compared(dtype: str) -> dict[str, dict]:
    """--compare-kernels: the C++ kernels (services/shard/cpu_kernels/) against torch's ops, at one dtype."""
    return {"C++ kernels": dict(dtype=dtype), "torch ops": dict(dtype=dtype, cpu_kernels=False)}


def compare(
    model_dir: str, batch: int, prompt_tokens: int, output_tokens: int, runners: dict[str, dict] = COMPARED
) -> dict[str, float]:
    """Median decode step ms of each of `runners` (name -> Batch arguments), their steps interleaved."""
    batches = {name: Batch(model_dir, batch, prompt_tokens, output_tokens, **kw) for name, kw in runners.items()}
    for name, b in batches.items():
        if runners[name].get("decoder_walk", True) and b.runner.walk is None:
            print(f"{name}: transformers' forward ({b.runner.walk_reason})", file=sys.stderr)
    for b in batches.values():
        b.warm()
        b.start()
        b.prefill()
    steps: dict[str, list[float]] = {name: [] for name in batches}
    while any(b.has_work() for b in batches.values()):
        for name, b in batches.items():
            if b.has_work():
                with clock.Lap() as lap:
                    b.engine.step()
                steps[name].append(lap.wall)
    return {name: clock.p50_ms(s) for name, s in steps.items()}


def joined(model_dir: str, batch: int, prompt_tokens: int, join_tokens: int, steps: int, dtype: str) -> dict:
    """Median ms of a decode step of `batch` rows alone and with one `join_tokens` prompt prefilled beside them
    (a fresh request of one new token each time, ending with its step), alternated over `steps` steps."""
    from bench.engine import request

    b = Batch(model_dir, batch, prompt_tokens, steps + 2, dtype=dtype, spare_tokens=join_tokens,
              max_prefill_tokens=max(4096, batch + join_tokens))  # fmt: skip
    b.warm()
    b.start()
    b.prefill()
    times: dict[str, list[float]] = {"decode": [], "with a join": []}
    fed: dict[str, set[int]] = {"decode": set(), "with a join": set()}  # tokens a step of each kind fed
    seen: list[int] = []
    b.engine.on_step = lambda plan, result: seen.append(len(plan.token_ids))
    for k in range(steps):
        kind = "with a join" if k % 2 else "decode"
        if k % 2:
            b.engine.add(request(f"join{k}", b.prompt(join_tokens), 1))
        with clock.Lap() as lap:
            b.engine.step()
        times[kind].append(lap.wall)
        fed[kind].add(seen[-1])
    out = {name: clock.p50_ms(t) for name, t in times.items()}
    return {**out, "tokens": {name: sorted(n) for name, n in fed.items()}}


def table(label: str, rows: list[dict]) -> list[str]:
    head = f"{label} ({rows[0]['dtype']}, {rows[0]['forward']} forward)"
    lines = [f"{head}: median ms per decode step, share of the step in brackets", ""]
    lines.append("| part | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |")
    lines.append("|---|" + "---:|" * len(rows))
    for part in PARTS:
        cells = [f"{r['parts_ms'][part]:.2f} ({100 * r['parts_ms'][part] / r['step_ms']:.0f}%)" for r in rows]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{r['step_ms']:.2f}**" for r in rows) + " |")
    lines.append("| tok/s (decode) | " + " | ".join(f"{1000 * r['batch'] / r['step_ms']:.0f}" for r in rows) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="comma-separated benchmark models (bench/models.py) or folders")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="auto (the server's default on this CPU) | float32 | bfloat16")
    ap.add_argument("--torch-linears", action="store_true", help="torch's own linears (the shard's oneDNN switch off)")
    ap.add_argument("--compare", action="store_true", help="bf16 oneDNN / bf16 torch / fp32 oneDNN steps, interleaved")
    ap.add_argument("--compare-walk", action="store_true", help="decoder walk / transformers' forward, interleaved")
    ap.add_argument("--compare-kernels", action="store_true", help="C++ kernels / torch ops, interleaved")
    ap.add_argument("--no-walk", action="store_true", help="profile transformers' forward (the decoder walk off)")
    ap.add_argument("--join-tokens", type=int, default=0, help="decode steps alone vs with one prompt this long")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from bench import models
    from libs.runtime.cpu import choose_dtype

    machine.shard_threads()  # as the shard
    dtype = choose_dtype(args.dtype).dtype
    out = {}
    if not args.json:
        print(machine.line(), end="\n\n", flush=True)
    for name in args.model.split(","):
        label, folder = models.resolve(name)
        if args.join_tokens:
            for b in args.batch.split(","):
                got = joined(
                    str(folder),
                    int(b),
                    args.prompt_tokens,
                    args.join_tokens,
                    args.output_tokens,
                    dtype,
                )
                out.setdefault(label, []).append({"batch": int(b), "step_ms": got})
                if not args.json:
                    cells = ", ".join(f"{k} {v:.1f} ms" for k, v in got.items() if k != "tokens")
                    print(f"{label} batch {b}, a {args.join_tokens}-token prompt joining: {cells}", flush=True)
            continue
        if args.compare or args.compare_walk or args.compare_kernels:
            runners = COMPARED
            if args.compare_walk:
                runners = walk_compared(dtype)
            elif args.compare_kernels:
                runners = kernels_compared(dtype)
            for b in args.batch.split(","):
                got = compare(str(folder), int(b), args.prompt_tokens, args.output_tokens, runners)
                if args.compare_walk:
                    got["ratio"] = got["transformers' forward"] / got["decoder walk"]
                elif args.compare_kernels:
                    got["ratio"] = got["torch ops"] / got["C++ kernels"]
                out.setdefault(label, []).append({"batch": int(b), "step_ms": got})
                if not args.json:
                    cells = [f"{k} {v:.2f}x" if k == "ratio" else f"{k} {v:.2f} ms" for k, v in got.items()]
                    print(f"{label} batch {b}: " + ", ".join(cells), flush=True)
            continue
        rows = [
            profile(
                str(folder),
                int(b),
                args.prompt_tokens,
                args.output_tokens,
                dtype,
                not args.torch_linears,
                not args.no_walk,
            )
            for b in args.batch.split(",")
        ]
        out[label] = rows
        if not args.json:
            print("\n".join(table(label, rows)), end="\n\n", flush=True)
    if args.json:
        json.dump(out, sys.stdout)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
