"""What this machine's processor can do, and the serving dtype that follows from it.

The default dtype (`--dtype` unset, or `auto`) follows vLLM and SGLang: a checkpoint is served in half
precision. On a CUDA device that is the checkpoint's own 16-bit dtype (bf16 for a float32 checkpoint, fp16 where
the GPU has no bf16). On a CPU it is bf16 only where the CPU computes in it natively (AVX512-BF16, AMX-BF16 or
AVX-NE-CONVERT: oneDNN's bf16 products run several times faster than fp32 there); elsewhere bf16 is emulated,
slower than float32, and oneDNN's bf16 weight prepack fails outright, so float32 it is. `--dtype float32` is the
exact mode: greedy output equals transformers' `generate()` token for token (the tests run in it).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# /proc/cpuinfo flags that mean bf16 arithmetic in hardware, each enough on its own
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
# the flags worth printing beside a benchmark figure: what decides which kernels run
REPORTED_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "avx_ne_convert",
)
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_HELP = (
    "auto (default: bf16 where the CPU or GPU computes it natively, else float32) | float32 (exact: greedy output "
    "equals transformers') | bfloat16 | float16"
)


def torch_cpu_build() -> bool:
    """Whether the installed torch is a CPU-only build (its version ends in "+cpu"), so that no GPU can serve: the
    launcher learns it without importing torch, which costs seconds of every start."""
    from importlib import metadata

    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return True


@cache
def flags() -> frozenset[str]:
    """The processor's feature flags (Linux /proc/cpuinfo); empty where that cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86 says flags, arm64 says Features
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@cache
def model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_bf16(cpu_flags: frozenset[str] | None = None) -> bool:
    cpu_flags = flags() if cpu_flags is None else cpu_flags
    return any(f in cpu_flags for f in NATIVE_BF16_FLAGS)


def describe(cpu_flags: frozenset[str] | None = None) -> str:
    """One line for logs and benchmark tables: the model name and the flags that decide the kernels."""
    shown = summary(cpu_flags)["flags"]
    return f"{model_name()} [{' '.join(shown) or 'no AVX2'}]"


def summary(cpu_flags: frozenset[str] | None = None) -> dict:
    """The processor as data (benchmark results): its model name, the flags that decide the kernels, its cores."""
    cpu_flags = flags() if cpu_flags is None else cpu_flags
    return {"model": model_name(), "flags": [f for f in REPORTED_FLAGS if f in cpu_flags], "cores": os.cpu_count() or 1}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # one of DTYPES
    reason: str  # why, for the start-up log line and /info


def choose_dtype(
    requested: str | None,
    checkpoint_dtype: str | None = None,
    device: str = "cpu",
    cpu_flags: frozenset[str] | None = None,
    cuda_bf16: bool = True,
) -> DtypeChoice:
    """The dtype to serve in: `requested` when it names one, else the default described above."""
    if requested and requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {requested!r}")
        return DtypeChoice(requested, "asked for with --dtype")
    if device.startswith("cuda"):
        if checkpoint_dtype in ("bfloat16", "float16") and (checkpoint_dtype == "float16" or cuda_bf16):
            return DtypeChoice(checkpoint_dtype, "the checkpoint's own dtype")
        if cuda_bf16:
            return DtypeChoice("bfloat16", f"half precision for a {checkpoint_dtype or 'float32'} checkpoint")
        return DtypeChoice("float16", "half precision; this GPU has no bf16")
    cpu_flags = flags() if cpu_flags is None else cpu_flags
    if native_bf16(cpu_flags):
        have = ", ".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags)
        return DtypeChoice("bfloat16", f"this CPU computes bf16 natively ({have}); --dtype float32 is exact")
    return DtypeChoice(
        "float32", "this CPU has no native bf16 (AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT), where bf16 is slower"
    )


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a model folder's config.json declares (`dtype`, or the older `torch_dtype`), if any."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    got = config.get("dtype") or config.get("torch_dtype")
    return got if got in DTYPES else None
