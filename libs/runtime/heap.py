"""The shard's heap kept for reuse: glibc's malloc set so that a step's large tensors come back from its heap.

By default glibc serves an allocation over its mmap threshold (128 KiB at first, rising to what it has seen freed,
never past 32 MiB) with a fresh mapping and unmaps it on free, so each of a long prefill's activations ([tokens,
intermediate]: megabytes, allocated again every layer) and each decode step's logits (64 rows of a 262k vocabulary
in bf16: 33.5 MiB) fault in their pages anew and the kernel zeroes them: tens of thousands of page faults per
2k-token prefill, 8,192 per such decode step. With mmap off for allocations and trimming only past TRIM_BYTES,
freed blocks stay in the heap and the next step's tensors reuse them. The process keeps its serving peak, which it
reaches again anyway; `release` gives back what loading the model left free. docs/benchmarks.md has the
measurement.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_BYTES = 1 << 30  # free memory at the heap's top returned to the system only past this

_state: dict = {}


def keep_for_reuse() -> bool:
    """Sets glibc's thresholds once per process; False (and why, logged once) where the C library is not glibc."""
    if "ok" in _state:
        return _state["ok"]
    ok, why, libc = False, "", None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            why = "the C library is not glibc"
        else:
            # no mmap for allocations (a failed heap growth still falls back to one), trimming past TRIM_BYTES
            ok = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
            why = "" if ok else "mallopt refused the thresholds"
    except OSError as e:
        why = str(e)
    _state["ok"], _state["libc"] = ok, libc if ok else None  # `release` trims only a heap kept here
    if ok:
        log.info("heap: large blocks come from the heap and are reused (no mmap, trim past %d MiB)", TRIM_BYTES >> 20)
    else:
        log.warning("heap: glibc's thresholds not set (%s); large tensors are mapped afresh", why)
    return ok


def release() -> int:
    """Returns the heap's free pages to the system (malloc_trim): once after loading, whose transient copies would
    otherwise stay resident. 1 if memory was released, 0 if not (or the heap is not kept)."""
    libc = _state.get("libc")
    return int(libc.malloc_trim(0)) if libc is not None else 0
