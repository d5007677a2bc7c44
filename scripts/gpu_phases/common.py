"""What the phases share: the repo root, timing, and which attention backends ModelRunner can run here."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import time
from pathlib import Path

import torch

from services.shard.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int = 10, warmup: int = 3, args: tuple = ()) -> float:
    """Mean seconds of one call of `fn(*args)` (after warm-up calls), the device synchronized around the timed
    ones."""
    for _ in range(warmup):
        fn(*args)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    sync(device)
    return (time.perf_counter() - t) / reps


def triton_module():
    """The Triton attention module, or the reason it cannot run here."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return None, "triton is not installed"
    try:
        mod = importlib.import_module("services.shard.attention.triton")
    except ImportError as e:
        return None, f"services/shard/attention/triton.py not importable ({e})"
    if not hasattr(mod, "attend_layer_triton"):
        return None, "services/shard/attention/triton.py has no attend_layer_triton"
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            return None, "needs CUDA, or TRITON_INTERPRET=1 on a CPU"
        from tests.triton_interpreter import install_interpreter_shims  # the interpreter's gaps on a CPU

        install_interpreter_shims()
    return mod, ""


def runner_takes(name: str) -> bool:
    return name in inspect.signature(ModelRunner.__init__).parameters


def attention_backends() -> list[str]:
    """The attention backends ModelRunner can run here: torch always, triton where the module and the parameter
    are there."""
    mod, _ = triton_module()
    return ["torch"] + (["triton"] if mod is not None and runner_takes("attention") else [])


def backend_kwargs(backend: str) -> dict:
    """ModelRunner's keyword for `backend`, named even for torch (the runner's default may pick triton on CUDA)."""
    return {"attention": backend} if runner_takes("attention") else {}
