"""The machine a benchmark ran on, described one way for every benchmark: the processor as libs/runtime/cpu.py reads
it (model name, the flags that decide the kernels, cores), torch's version and threads, the load average; and
torch's threads set as the shard process sets them."""

from __future__ import annotations

import os
import platform

from libs.runtime import cpu


def processor() -> str:
    """The processor in a few words: its model name, the flags that decide the kernels, its cores."""
    return f"{cpu.describe()}, {cpu.summary()['cores']} cores"


def line() -> str:
    """One line above an in-process benchmark's table: the processor, torch's version and threads."""
    import torch

    return f"{processor()}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def info() -> dict:
    """The machine for a results.json: the processor, cores, memory, Python's, torch's and transformers' versions,
    the load average now."""
    import torch
    import transformers

    out = {"cpu": processor(), "cores": cpu.summary()["cores"], "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__, "load_avg_start": load()}  # fmt: skip
    try:
        out["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return out


def load() -> list[float]:
    """The load average over 1, 5 and 15 minutes: how busy the machine was around a measurement."""
    return [round(v, 2) for v in os.getloadavg()]


def shard_threads(default: int | None = None) -> int:
    """Sets torch's threads as the shard process does (Settings.torch_threads, SWITCHYARD_TORCH_THREADS; else
    `default`, else every core) and returns them; keeps the heap for reuse as the shard does."""
    import torch

    from libs.runtime import heap
    from libs.runtime.settings import Settings

    heap.keep_for_reuse()

    threads = Settings.from_env().torch_threads or default or cpu.summary()["cores"]
    torch.set_num_threads(threads)
    return threads
