"""Quantized linear kernels against dense ones, per layer: why services/shard/quant_linear.py picks what it picks.

For each layer shape and row count (the M of a step: 1 for one decoding stream, 16/64 for batches, 256 for a
prefill chunk) this prints the median ms of fp32 and bf16 (oneDNN, prepacked, as the shard runs dense layers),
W8A8 (`torch._int_mm`), and the int4 / int8 weight-only layers as the shard runs them, with float32 and with
bfloat16 activations (the kernel below `dense_from[dtype]` rows, a dequantized scratch product from there on;
`--force kernel|dense` pins one), and the resident weight bytes of each. All ways of one shape are measured
interleaved in one process, so load on a shared machine hits them alike; read ratios, not absolute times.

    python -m launcher.bench.quant [--shapes 2048x8192,576x1536] [--rows 1,16,64,256] [--rounds 5]

With `--model NAME|DIR` it times whole decode steps instead: transformers' forward with its KV cache over 1/16/64
streams (the shard's own paged step adds attention bookkeeping, the linears are the same), for fp32, bf16, W8A8
(eetq) and int4 (bitsandbytes-nf4), and prints tok/s and the resident weight bytes of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

from launcher.bench.timing import median_ms


def _ways(k: int, n: int, force: str | None = None):
    """name → (resident bytes, callable(x))."""
    import torch

    from services.shard import quant_linear as ql
    from services.shard.cpu_linear import PACK_FOR_BATCH
    from services.shard.quant_formats import quantize_rtn

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    ways = {}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH)
    ways["fp32"] = (w.numel() * 4, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], ""))
    try:
        packed16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), PACK_FOR_BATCH)
        bf = lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed16, None, "none", [None], "")  # noqa: E731
        bf(torch.randn(1, k))
        ways["bf16"] = (w.numel() * 2, bf)
    except RuntimeError:  # oneDNN refuses bf16 on CPUs without it (AVX2 only)
        pass
    w8a8 = ql.build(quantize_rtn(w, 8, -1, True, act_int8=True))
    ways["w8a8"] = (ql.resident_bytes(w8a8), w8a8)
    threshold = {None: None, "kernel": 1 << 62, "dense": 0}[force]
    group = 128 if k % 128 == 0 else 64
    for name, qw in (("int4", quantize_rtn(w, 4, group, False)), ("int8", quantize_rtn(w, 8, -1, True))):
        layer = ql.build(qw, threshold)
        ways[name] = (ql.resident_bytes(layer), layer)
        ways[f"{name} bf16"] = (ql.resident_bytes(layer), lambda x, layer=layer: layer(x.bfloat16()))
    return ways


def measure(shapes: list[tuple[int, int]], rows: list[int], rounds: int = 5, force: str | None = None) -> list[dict]:
    import torch

    out = []
    for k, n in shapes:
        ways = _ways(k, n, force)
        for m in rows:
            x = torch.randn(m, k)
            times = {name: [] for name in ways}
            reps = max(3, 40 // m)
            for _ in range(rounds):  # interleaved rounds
                for name, (_, fn) in ways.items():
                    times[name].append(median_ms(lambda fn=fn, x=x: fn(x), reps, warm=True))
            row = {"shape": f"{k}→{n}", "rows": m}
            row.update({name: statistics.median(t) for name, t in times.items()})
            out.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        fp32 = ways["fp32"][0]
        print(
            "resident weight bytes, share of fp32: "
            + ", ".join(f"{name.split()[0]} {b / fp32:.0%}" for name, (b, _) in ways.items() if "bf16" not in name[1:]),
            flush=True,
        )
    return out


def _model_weight_bytes(model) -> int:
    from services.shard import quant_linear as ql

    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(ql.resident_bytes(m) for m in model.modules() if isinstance(m, ql._QuantLinear))


def measure_model(model_dir: str, streams: list[int], steps: int = 8, prompt: int = 16) -> list[dict]:
    """tok/s of decode steps and resident weight bytes, per way of serving `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from services.shard import quant_linear as ql
    from services.shard.cpu_linear import use_onednn

    ways = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None)]
    ways += [("w8a8", torch.float32, "eetq"), ("int4", torch.float32, "bitsandbytes-nf4")]
    ways += [("w8a8 bf16", torch.bfloat16, "eetq"), ("int4 bf16", torch.bfloat16, "bitsandbytes-nf4")]
    out = []
    for name, dtype, method in ways:
        if method:
            model = ql.from_pretrained(model_dir, method, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.eval()
        if dtype == torch.float32:
            use_onednn(model)  # as the shard does: the linears that stayed dense, prepacked
        row = {"way": name, "weights MB": _model_weight_bytes(model) / 2**20}
        for b in streams:
            ids = torch.randint(100, 1000, (b, prompt), generator=torch.Generator().manual_seed(b))
            with torch.inference_mode():
                cache = DynamicCache()
                logits = model(ids, past_key_values=cache, use_cache=True).logits
                times = []
                for _ in range(steps):
                    nxt = logits[:, -1:].argmax(-1)
                    t = time.perf_counter()
                    logits = model(nxt, past_key_values=cache, use_cache=True).logits
                    times.append(time.perf_counter() - t)
            row[f"tok/s@{b}"] = b / statistics.median(times)
        out.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from libs.runtime import cpu
    from services.shard.quant_linear import INT4_DENSE_FROM, INT8_DENSE_FROM

    p = argparse.ArgumentParser(prog="python -m launcher.bench.quant", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2048x8192,576x1536", help="in×out of each layer (SmolLM2-135M's MLP: 576x1536)")
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--force", choices=("kernel", "dense"), help="run the weight-only layers one way at every size")
    p.add_argument("--model", help="time whole decode steps of this model (embedded short name or folder) instead")
    p.add_argument("--streams", default="1,16,64", help="with --model: concurrent streams")
    p.add_argument("--threads", type=int, help="torch threads (1 on an oversubscribed machine: a thread team waiting")
    args = p.parse_args(argv)
    if args.threads:  # on a descheduled member costs more than the second thread brings)
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {cpu.describe()}")
    if args.model:
        from libs.runtime import model_store

        folder = str(model_store.resolve_model(args.model))
        measure_model(folder, [int(s) for s in args.streams.split(",")])
        return 0
    dense_from = {"int4": INT4_DENSE_FROM, "int8": INT8_DENSE_FROM}
    for name, table in dense_from.items():
        print(
            f"{name} dequantizes into a scratch buffer from " + ", ".join(f"{n} rows ({d})" for d, n in table.items())
        )
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    measure(shapes, [int(r) for r in args.rows.split(",")], args.rounds, args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
