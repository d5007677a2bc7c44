"""One model step with LoRA rows against the same step on the base model alone, in process.

The bench model (`smollm2`) in the serving dtype, its linears switched to oneDNN as the shard does (`use_onednn`),
with the `lora` workload's adapters (4, every projection, r 16, built with peft) in a `LoraRegistry`. A step is one
forward over `rows` one-token rows (a decode step's linear work; no KV cache). The mixed step spreads the rows
round robin over the base model and the adapters (`--base-share` on the base); `--adapter-dtypes model,float32`
adds the adapters in float32, `unfolded` their shrink kept out of the base product (services/shard/lora/fold.py).
All steps are timed interleaved, `rounds` times, and the medians compared: what the LoRA rows cost a step.

    python -m bench.step.lora [--rows 16,64] [--threads N] [--dtype bfloat16] [--rounds 7] [--cpu-clock]
        [--adapter-dtypes model,float32,unfolded]
"""

from __future__ import annotations

import argparse
import statistics

from bench import clock, machine


def _rotation(names: list[str], base_share: float, rows: int) -> list[str | None]:
    """Each row's adapter: every 1/base_share-th row on the base model, the others round robin over `names`."""
    every = round(1 / base_share) if base_share > 0 else 0
    out, k = [], 0
    for i in range(rows):
        if every and i % every == every - 1:
            out.append(None)
        else:
            out.append(names[k % len(names)])
            k += 1
    return out


def measure(
    rows_list: list[int],
    dtype: str,
    rounds: int,
    reps: int,
    base_share: float,
    cpu_clock: bool = False,
    adapter_dtypes: tuple[str, ...] = ("model",),
):
    import torch
    from transformers import AutoModelForCausalLM

    from bench import models
    from bench.workloads import lora as lora_serving
    from services.shard.lora.registry import LoraRegistry
    from services.shard.model.onednn import use_onednn

    model_dir = models.build_llama("smollm2")
    adapters = lora_serving.build_adapters(model_dir, "smollm2", 4, [16])
    setups = {}  # adapter dtype → (model, registry): one model each, as a registry wraps its model's linears
    for adapter_dtype in adapter_dtypes:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
        )
        model.eval()
        use_onednn(model)
        lora_dtype = None if adapter_dtype in ("model", "unfolded") else getattr(torch, adapter_dtype)
        registry = LoraRegistry(
            model, max_loras=len(adapters), max_rank=16, dtype=lora_dtype, fold=adapter_dtype != "unfolded"
        )
        for name, folder in adapters.items():
            registry.load(name, folder)
        registry.check_hooks()
        setups[adapter_dtype] = (model, registry)
    names = list(adapters)
    results = []
    gen = torch.Generator().manual_seed(0)
    for rows in rows_list:
        ids = torch.randint(3, model.config.vocab_size, (rows, 1), generator=gen)
        mix = _rotation(names, base_share, rows)

        model, registry = setups[adapter_dtypes[0]]

        def base_step(ids=ids, model=model, registry=registry):
            registry.clear_step()
            return model(input_ids=ids, use_cache=False).logits

        def mixed_step(model, registry, ids=ids, mix=mix):
            registry.set_step(mix)  # once per step, as the runner does: counted in the step's time
            try:
                return model(input_ids=ids, use_cache=False).logits
            finally:
                registry.clear_step()

        steps = {"base": base_step}
        steps.update({k: (lambda m=m, r=r: mixed_step(m, r)) for k, (m, r) in setups.items()})
        times: dict[str, list[float]] = {k: [] for k in steps}
        with torch.inference_mode():
            base_logits = base_step()  # warm up; the adapters change the output, base rows keep it exactly
            on_base = [i for i, a in enumerate(mix) if a is None]
            for k in setups:
                mixed_logits = steps[k]()
                torch.testing.assert_close(mixed_logits[on_base], base_logits[on_base], atol=0, rtol=0)
                assert not torch.equal(mixed_logits, base_logits)
            by = clock.cpu if cpu_clock else clock.wall  # CPU time: others' processes on the cores do not count
            for _ in range(rounds):
                for k, fn in steps.items():
                    times[k].append(clock.median_ms(fn, reps, clock=by))
        base = statistics.median(times["base"])
        for k in setups:
            mixed = statistics.median(times[k])
            results.append({"rows": rows, "adapters": k, "base_ms": base, "mixed_ms": mixed, "ratio": base / mixed})
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| rows | adapters in | base step ms | LoRA-mix step ms | base / mix (throughput ratio) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['adapters']} | {r['base_ms']:.2f} | {r['mixed_ms']:.2f} | {100 * r['ratio']:.1f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64", help="rows per step (comma list)")
    parser.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 (what the shard serves in)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=3, help="steps per timing (median of rounds)")
    parser.add_argument("--base-share", type=float, default=0.2, help="fraction of rows on the base model")
    parser.add_argument("--cpu-clock", action="store_true", help="time by this process's CPU time (busy machine)")
    parser.add_argument(
        "--adapter-dtypes", default="model", help="adapters to compare: model,float32 (their dtype), unfolded"
    )
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(v) for v in args.rows.split(",")]
    adapter_dtypes = tuple(args.adapter_dtypes.split(","))
    results = measure(rows, args.dtype, args.rounds, args.reps, args.base_share, args.cpu_clock, adapter_dtypes)
    by = "CPU time" if args.cpu_clock else "wall time"
    print(machine.line())
    print(f"smollm2 shape, 4 adapters r 16 on every projection, {args.dtype}, {by}")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
