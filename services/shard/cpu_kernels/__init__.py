"""The decode step's small kernels in C++ for the CPU, as torch ops (`torch.ops.switchyard_cpu.*`).

Between the oneDNN products a layer's remaining work is small (a few thousand values per row) and torch runs it as
tens of ATen calls, each a parallel region whose threads meet at a barrier: their fixed cost outweighs their work at
decode, and a thread the kernel preempts stalls every one of them. Each kernel here does one such stretch in one
pass and one parallel region: the attention of short rows reading the pages in place (attention.cpp), the residual
add with the RMSNorm after it (norm.cpp), Gemma-3's q/k norms with the rotary embedding (rotary.cpp), the gated
activation (activation.cpp); after the forward, the token choice over the logits as they are (sampling.cpp). For
prefill, long bf16 rows on a CPU with AMX take a flash attention of their own (flash_attention.cpp, called by the
tiled path), and the step's K/V go into the pages by one copy per token and head (kv_write.cpp). The norm, rotary
and SiLU kernels round where the torch ops round (bit-identical to them); the attentions keep their scores and sums
in float32. The float32 exact mode never calls them (bit-identity with transformers is the torch path's).

Built on first use by torch's extension builder (g++, FLAGS: `-march=native` with 512-bit vectors where the CPU has
them, which change no result since nothing is reassociated) and cached in the model cache's
`cpu_kernels/` folder under a key of the sources, the torch version and the CPU's flags, so a second start loads the
library in a fraction of a second and a cache shared between different CPUs never runs another CPU's build. Where
no compiler or build works, `load` says why once and the callers keep the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch

from libs.runtime import cpu, model_store

log = logging.getLogger(__name__)

SOURCES = (
    "attention.cpp", "flash_attention.cpp", "kv_write.cpp", "norm.cpp", "rotary.cpp", "activation.cpp", "sampling.cpp"
)  # fmt: skip
HEADERS = ("common.h",)
# -fopenmp: at::parallel_for is OpenMP in the headers; the library binds to the libgomp torch has loaded
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno"]

_state: dict = {}  # "ok": bool, "reason": str, "build_s": float (once per process)


def build_dir() -> Path:
    """Where this CPU's build lives: the model cache (SWITCHYARD_CACHE, else ~/.cache/switchyard), keyed."""
    here = Path(__file__).parent
    key = hashlib.sha256()
    for name in SOURCES + HEADERS:
        key.update((here / name).read_bytes())
    key.update(" ".join(FLAGS).encode())
    key.update(torch.__version__.encode())
    key.update(" ".join(sorted(cpu.flags())).encode())
    key.update(cpu.model_name().encode())
    return model_store.cache_dir() / "cpu_kernels" / key.hexdigest()[:16]


def load() -> bool:
    """Whether the kernels are loaded (built first if this CPU's build is not cached); the first call decides and
    logs it, later calls repeat the answer."""
    if "ok" in _state:
        return _state["ok"]
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load as build_extension

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        here = Path(__file__).parent
        build_extension(
            "switchyard_cpu_kernels",
            [str(here / name) for name in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        _state.update(ok=True, reason="", build_s=time.perf_counter() - started)
        log.info("cpu kernels: loaded in %.1f s from %s", _state["build_s"], folder)
    except Exception as e:  # no compiler, a failed build: the torch path serves
        lines = str(e).strip().splitlines() or [""]
        said = next((line.strip() for line in lines if "error:" in line), lines[-1])  # the compiler's first
        _state.update(ok=False, reason=f"{type(e).__name__}: {said}")
        log.warning("cpu kernels: not built (%s); the torch ops serve", _state["reason"])
    return _state["ok"]


def reason() -> str:
    """Why the kernels are not loaded ("" when they are, or before `load`)."""
    return _state.get("reason", "")


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps on `device` in `dtype` take the kernels: on CPU in half precision (float32 is the exact mode)."""
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
