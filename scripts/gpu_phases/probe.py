"""Phase 0, probe: versions, TF32 off, measured copy bandwidth and bf16 matmul rate."""

from __future__ import annotations

import importlib
import importlib.util
import platform

import torch

from .common import timed, triton_module
from .report import Report


def phase0(rep: Report, dev: torch.device, quick: bool) -> None:
    import transformers

    mod, why = triton_module()
    try:
        triton_version = importlib.import_module("triton").__version__
    except ImportError:
        triton_version = None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    versions = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton_version,
        transformers=transformers.__version__,
        cuda=torch.version.cuda,
        device=str(dev),
        gpu=gpu,
        tf32=torch.backends.cuda.matmul.allow_tf32,
        triton_attention=mod is not None or why,
    )
    rep.meta.update(versions)
    rep.add(0, "versions", "ok", ", ".join(f"{k} {v}" for k, v in versions.items()), **versions)

    n = (16 << 20) if quick else (2 << 30)  # bytes copied; ×2 moved (read + write)
    src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    sec = timed(src.clone().copy_, dev, reps=5 if quick else 20, args=(src,))
    gbs = 2 * n / sec / 1e9
    rep.add(0, "copy bandwidth", "ok", f"{gbs:.0f} GB/s (read + write, {n >> 20} MiB copy)", gb_per_s=gbs)
    src = None

    size = 256 if quick else 8192
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    sec = timed(lambda: a @ b, dev, reps=3 if quick else 10)
    tflops = 2 * size**3 / sec / 1e12
    rep.add(0, "bf16 matmul", "ok", f"{tflops:.1f} TFLOP/s ({size}³, random)", tflops=tflops)
