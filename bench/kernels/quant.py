"""Quantized linear kernels against dense ones, per layer: why services/shard/quant/loader.py picks what it picks.

Per layer shape and row count (the M of a step), the median ms of fp32 and bf16 (oneDNN, prepacked, as the shard
runs dense layers), W8A8 and the int4 / int8 weight-only layers as the shard runs them (float32 and bf16
activations; `--force kernel|dense` pins one path), and the resident weight bytes of each, all interleaved in one
process: read ratios, not absolute times. `--w8a8`: torch's int8 kernels (W8A8 as served, `_int_mm` alone, oneDNN's
`qlinear_pointwise`, `quantized::linear_dynamic`) against the bf16 product, on SmolLM2-135M's shapes by default.
`--model M --steps`: the shard's decode steps in fp32, bf16 and W8A8 through the in-process engine, interleaved
(bench/step/profile.py's comparison); `--model M` alone: transformers' decode steps per way, tok/s and weight bytes.

    python -m bench.kernels.quant [--shapes 2048x8192,576x1536] [--rows 1,16,64,256] [--w8a8] [--model M --steps]
"""

from __future__ import annotations

import argparse
import statistics

from bench import clock, machine
from bench.clock import median_ms


def _ways(k: int, n: int, force: str | None = None):
    """name → (resident bytes, callable(x))."""
    import torch

    from services.shard.model.onednn import PACK_FOR_BATCH
    from services.shard.quant import layers as quant_layers
    from services.shard.quant import loader as ql
    from services.shard.quant.formats import quantize_rtn

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
    w8a8 = quant_layers.build(quantize_rtn(w, 8, -1, True, act_int8=True))
    ways["w8a8"] = (ql.resident_bytes(w8a8), w8a8)
    threshold = {None: None, "kernel": 1 << 62, "dense": 0}[force]
    group = 128 if k % 128 == 0 else 64
    for name, qw in (("int4", quantize_rtn(w, 4, group, False)), ("int8", quantize_rtn(w, 8, -1, True))):
        layer = quant_layers.build(qw, threshold)
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


W8A8_SHAPES = "576x960,576x576,576x3072,1536x576,576x192,576x1536"  # SmolLM2-135M: q/k/v, o, gate/up, down, ...


def _w8a8_ways(k: int, n: int):
    """name → callable(x bf16 [M, K]) for the int8 kernels torch has, against the bf16 product."""
    import warnings

    import torch

    from services.shard.model.onednn import PACK_FOR_BATCH, dtype_supported
    from services.shard.quant.layers import w8a8_product

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    scales = w.abs().amax(1) / 127
    levels = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    dense = (levels.float() * scales[:, None]).bfloat16()
    if dtype_supported(torch.bfloat16):
        packed_dense = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_FOR_BATCH)
        ways = {"bf16 oneDNN": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_dense, None, "none", [None], "")}
    else:  # AVX2-only CPUs: oneDNN packs no bf16, so the baseline is torch's own bf16 product
        ways = {"bf16 torch": lambda x: torch.nn.functional.linear(x, dense)}
    ways["W8A8 served"] = lambda x: w8a8_product(x, levels, scales)
    quantized: dict[int, torch.Tensor] = {}  # the activations quantized once per row count: the kernel alone

    def int_mm_alone(x):
        q = quantized.get(x.shape[0])
        if q is None:
            q = quantized[x.shape[0]] = x.to(torch.int8)
        return torch._int_mm(q, levels.t())

    ways["_int_mm alone"] = int_mm_alone
    packed = torch.ops.onednn.qlinear_prepack(levels, [64, k])  # without a shape its calls run far slower
    zeros = torch.zeros(n, dtype=torch.long)

    def qlinear(x):
        s = x.abs().amax(-1, keepdim=True).float().div_(127).clamp_min_(1e-12)
        q = torch.div(x, s).round_().add_(128).to(torch.uint8)  # int8 activations take oneDNN's reference path
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 128, packed, scales, zeros, None, 1.0, 0, x.dtype, "none", [], ""
        )
        return y.mul_(s)

    ways["qlinear_pointwise"] = qlinear
    with warnings.catch_warnings():  # quantize_per_channel is deprecated in torch 2.13
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(levels.float() * scales[:, None], scales.double(), zeros, 0, torch.qint8)
        prepacked = torch.ops.quantized.linear_prepack(qweight, None)
    ways["linear_dynamic"] = lambda x: torch.ops.quantized.linear_dynamic(x.float(), prepacked, False).to(x.dtype)
    return ways


def measure_w8a8(shapes: list[tuple[int, int]], rows: list[int], reps: int = 100) -> list[dict]:
    """The fastest of `reps` calls (µs) of each way, interleaved: a busy machine inflates medians, not minimums."""
    import torch

    out = []
    for k, n in shapes:
        ways = _w8a8_ways(k, n)
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            best = dict.fromkeys(ways, float("inf"))
            with torch.inference_mode():
                for fn in ways.values():
                    fn(x)
                for _ in range(reps):
                    for name, fn in ways.items():
                        (took,) = clock.times(lambda fn=fn, x=x: fn(x), 1)
                        best[name] = min(best[name], took)
            row = {"shape": f"{k}→{n}", "rows": m, **{name: 1e6 * v for name, v in best.items()}}
            out.append(row)
            print(
                " | ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True
            )
    return out


def measure_steps(model_dir: str, streams: list[int], steps: int = 24, prompt: int = 32) -> dict[int, dict[str, float]]:
    """Median ms of the shard's decode steps for fp32, bf16 and W8A8, interleaved in one process."""
    from bench.step.profile import compare

    runners = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16")}
    runners["w8a8"] = dict(dtype="bfloat16", quantize="eetq")
    out = {}
    for b in streams:
        got = compare(model_dir, b, prompt, steps, runners)
        out[b] = got
        ratios = ", ".join(f"{name} {got['fp32'] / got[name]:.2f}x" for name in ("bf16", "w8a8"))
        cells = ", ".join(f"{name} {v:.1f} ms" for name, v in got.items())
        print(f"{b} streams: {cells}; tok/s vs fp32: {ratios}", flush=True)
    return out


def _model_weight_bytes(model) -> int:
    from services.shard.quant import layers as quant_layers
    from services.shard.quant import loader as ql

    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(ql.resident_bytes(m) for m in model.modules() if isinstance(m, quant_layers.QuantLinear))


def measure_model(model_dir: str, streams: list[int], steps: int = 8, prompt: int = 16) -> list[dict]:
    """tok/s of decode steps and resident weight bytes, per way of serving `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from services.shard.model.onednn import use_onednn
    from services.shard.quant import loader as ql

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
                    t = clock.wall()
                    logits = model(nxt, past_key_values=cache, use_cache=True).logits
                    times.append(clock.wall() - t)
            row[f"tok/s@{b}"] = 1000 * b / clock.p50_ms(times)
        out.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from services.shard.quant.layers import INT4_DENSE_FROM, INT8_DENSE_FROM

    p = argparse.ArgumentParser(prog="python -m bench.kernels.quant", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help="in×out of each layer (default 2048x8192,576x1536; --w8a8: SmolLM2's)")
    p.add_argument("--rows", help="rows of each product (default 1,16,64,256; --w8a8: 1,16,64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--force", choices=("kernel", "dense"), help="run the weight-only layers one way at every size")
    p.add_argument("--w8a8", action="store_true", help="torch's int8 kernels against bf16 (default shapes: SmolLM2)")
    p.add_argument("--steps", action="store_true", help="with --model: fp32 / bf16 / W8A8 runner steps, same run")
    p.add_argument("--model", help="time whole decode steps of this model (embedded short name or folder) instead")
    p.add_argument("--streams", default="1,16,64", help="with --model: concurrent streams")
    p.add_argument("--threads", type=int, help="torch threads (1 on an oversubscribed machine: a thread team waiting")
    args = p.parse_args(argv)
    if args.threads:  # on a descheduled member costs more than the second thread brings)
        torch.set_num_threads(args.threads)
    print(machine.line())
    if args.w8a8:
        shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or W8A8_SHAPES).split(",")]
        measure_w8a8(shapes, [int(r) for r in (args.rows or "1,16,64").split(",")])
        return 0
    if args.model:
        from bench import models

        folder = str(models.resolve(args.model)[1])  # smollm2, gemma, ... (bench/models.py) or a folder
        if args.steps:
            measure_steps(folder, [int(s) for s in args.streams.split(",")])
            return 0
        measure_model(folder, [int(s) for s in args.streams.split(",")])
        return 0
    dense_from = {"int4": INT4_DENSE_FROM, "int8": INT8_DENSE_FROM}
    for name, table in dense_from.items():
        print(
            f"{name} dequantizes into a scratch buffer from " + ", ".join(f"{n} rows ({d})" for d, n in table.items())
        )
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or "2048x8192,576x1536").split(",")]
    measure(shapes, [int(r) for r in (args.rows or "1,16,64,256").split(",")], args.rounds, args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
