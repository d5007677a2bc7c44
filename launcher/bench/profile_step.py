"""Where a decode step's time goes: the shard's ModelRunner.execute in one process (as launcher.bench.limit runs it),
timed part by part with timers the bench wraps around it (the runner itself carries none).

The parts of one decode step of the whole batch, each the median over the steps:
- wire in: decoding the plan's frames (what the shard does before `execute`);
- prepare: checking the plan's rows and laying them out (positions, slots, block tables, tensors);
- layers: the model's body, embedding to final norm (a pre- and a post-hook on `model.model`);
- LM head: the output projection (hooks on the output embeddings), on the kept positions only;
- forward other: the rest of the forward call (logits_to_keep, softcapping, the output object);
- sampling: processors, the choice and its logprob;
- pack: the sampled tokens into the result's arrays;
- execute other: the plan's diff (new and finished sequences), the result object;
- publish: encoding the result's frames (what the shard sends).

    python -m launcher.bench.profile_step --model llama-128k,smollm2,gemma --batch 1,16,64 [--dtype auto]
        [--torch-linears] [--no-lean]

With --compare, instead: the whole step of three runners side by side — bf16 with the oneDNN linears (the
default on a CPU with native bf16), bf16 with torch's linears, float32 with the oneDNN linears — one step of each
in turn, so that load on the machine hits all three alike. With --compare-lean, the same for the lean decoder walk
(services/shard/model/decoder_walk.py) against transformers' forward at the chosen dtype, with their ratio. With
--join-tokens N, a decode step of the batch alone against the same step with one N-token prompt joining it (what a
request arriving mid-flight costs every decoding row), alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

PARTS = ("wire in", "prepare", "layers", "LM head", "forward other", "sampling", "pack", "execute other", "publish")


class StepTimers:
    """Per-step seconds of the named parts, from wrappers on the runner's methods and hooks on its modules."""

    def __init__(self, runner):
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        for name, part in (
            ("_prepare", "prepare"),
            ("_forward", "forward"),
            ("_sample", "sampling"),
            ("_pack", "pack"),
        ):
            setattr(runner, name, self._timed(getattr(runner, name), part))
        model = runner.model
        if runner.lean is not None:  # the lean walk does not call model.model: time its body instead
            runner.lean.body = self._timed(runner.lean.body, "layers")
        else:
            self._hook(model.model, "layers")
        self._hook(model.get_output_embeddings(), "LM head")

    def _timed(self, fn, part):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - t

        return wrapped

    def _hook(self, module, part):
        started = []
        module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))

        def done(*_):
            self.now[part] += time.perf_counter() - started.pop()

        module.register_forward_hook(done)

    def close_step(self, **measured: float) -> None:
        step = dict(self.now)
        step.update(measured)
        step["forward other"] = step.pop("forward", 0.0) - step.get("layers", 0.0) - step.get("LM head", 0.0)
        inner = sum(step.get(p, 0.0) for p in ("prepare", "layers", "LM head", "forward other", "sampling", "pack"))
        step["execute other"] = step.pop("execute") - inner
        self.steps.append(step)
        self.now.clear()

    def medians_ms(self) -> dict[str, float]:
        return {p: 1000 * statistics.median(s.get(p, 0.0) for s in self.steps) for p in PARTS}


def profile(
    model_dir: str,
    batch: int,
    prompt_tokens: int,
    output_tokens: int,
    dtype: str,
    onednn: bool = True,
    lean: bool = True,
) -> dict:
    from launcher.bench.limit import Driver
    from libs.protocol import codec

    driver = Driver(model_dir, batch, prompt_tokens, output_tokens, dtype=dtype, onednn_linear=onednn, lean=lean)
    driver.warm()
    driver.prefill()
    timers = StepTimers(driver.runner)
    totals = []
    for k in range(output_tokens - 1):
        frames = [bytes(f) for f in codec.encode(driver.decode_plan(k))]
        t0 = time.perf_counter()
        plan = codec.decode(frames)
        t1 = time.perf_counter()
        result = driver.runner.execute(plan)
        t2 = time.perf_counter()
        codec.encode(result)
        t3 = time.perf_counter()
        timers.close_step(**{"wire in": t1 - t0, "execute": t2 - t1, "publish": t3 - t2})
        totals.append(t3 - t0)
        driver.took(result)
    return {
        "batch": batch,
        "dtype": dtype,
        "forward": "lean" if driver.runner.lean is not None else "transformers",
        "step_ms": 1000 * statistics.median(totals),
        "parts_ms": timers.medians_ms(),
    }


COMPARED = {
    "bf16, oneDNN linears": dict(dtype="bfloat16"),
    "bf16, torch's linears": dict(dtype="bfloat16", onednn_linear=False),
    "fp32, oneDNN linears": dict(dtype="float32"),
}


def lean_compared(dtype: str) -> dict[str, dict]:
    """--compare-lean: the lean decoder walk against transformers' forward, at one dtype."""
    return {"lean walk": dict(dtype=dtype), "transformers' forward": dict(dtype=dtype, lean=False)}


def compare(
    model_dir: str, batch: int, prompt_tokens: int, output_tokens: int, runners: dict[str, dict] = COMPARED
) -> dict[str, float]:
    """Median decode step ms of each of `runners` (name -> Driver arguments), their steps interleaved."""
    from launcher.bench.limit import Driver

    drivers = {name: Driver(model_dir, batch, prompt_tokens, output_tokens, **kw) for name, kw in runners.items()}
    for name, driver in drivers.items():
        if runners[name].get("lean", True) and driver.runner.lean is None:
            print(f"{name}: transformers' forward ({driver.runner.lean_reason})", file=sys.stderr)
    for driver in drivers.values():
        driver.warm()
        driver.prefill()
    steps = {name: [] for name in drivers}
    for k in range(output_tokens - 1):
        for name, driver in drivers.items():
            t = time.perf_counter()
            driver.took(driver.runner.execute(driver.decode_plan(k)))
            steps[name].append(time.perf_counter() - t)
    return {name: 1000 * statistics.median(s) for name, s in steps.items()}


def joined(model_dir: str, batch: int, prompt_tokens: int, join_tokens: int, steps: int, dtype: str) -> dict:
    """Median ms of a decode step of `batch` rows alone and with one `join_tokens` prompt prefilled beside them
    (a fresh sequence each time, dropped after its step), alternated over `steps` steps."""
    from launcher.bench.limit import Driver

    driver = Driver(model_dir, batch, prompt_tokens, steps + 2, dtype=dtype)
    driver.warm()
    driver.prefill()
    times: dict[str, list[float]] = {"decode": [], "with a join": []}
    fed: dict[str, set[int]] = {"decode": set(), "with a join": set()}  # tokens a step of each kind fed
    for k in range(steps):
        kind = "with a join" if k % 2 else "decode"
        plan = driver.joined_plan(k, join_tokens) if k % 2 else driver.decode_plan(k)
        t = time.perf_counter()
        result = driver.runner.execute(plan)
        times[kind].append(time.perf_counter() - t)
        fed[kind].add(len(plan.token_ids))
        driver.took(result)  # the joined sequence's token too: the next decode plan reads only the batch's
    out = {name: 1000 * statistics.median(t) for name, t in times.items()}
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
    ap.add_argument(
        "--model", required=True, help="comma-separated benchmark models (launcher.bench.models) or folders"
    )
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="auto (the server's default on this CPU) | float32 | bfloat16")
    ap.add_argument("--torch-linears", action="store_true", help="torch's own linears (the shard's oneDNN switch off)")
    ap.add_argument("--compare", action="store_true", help="bf16 oneDNN / bf16 torch / fp32 oneDNN steps, interleaved")
    ap.add_argument("--compare-lean", action="store_true", help="lean walk / transformers' forward, interleaved")
    ap.add_argument("--no-lean", action="store_true", help="profile transformers' forward (the lean walk off)")
    ap.add_argument("--join-tokens", type=int, default=0, help="decode steps alone vs with one prompt this long")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from launcher.bench import models
    from libs.runtime.cpu import choose_dtype

    torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", os.cpu_count() or 1)))  # as the shard
    dtype = choose_dtype(args.dtype).dtype
    out = {}
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
                    str(dtype).removeprefix("torch."),
                )
                out.setdefault(label, []).append({"batch": int(b), "step_ms": got})
                if not args.json:
                    cells = ", ".join(f"{k} {v:.1f} ms" for k, v in got.items() if k != "tokens")
                    print(f"{label} batch {b}, a {args.join_tokens}-token prompt joining: {cells}", flush=True)
            continue
        if args.compare or args.compare_lean:
            runners = lean_compared(str(dtype).removeprefix("torch.")) if args.compare_lean else COMPARED
            for b in args.batch.split(","):
                got = compare(str(folder), int(b), args.prompt_tokens, args.output_tokens, runners)
                if args.compare_lean:
                    got["ratio"] = got["transformers' forward"] / got["lean walk"]
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
                not args.no_lean,
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
