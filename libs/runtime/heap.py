"""The shard's heap kept for reuse: glibc's malloc set so that a step's large tensors come back from its heap.

By default glibc serves an allocation over its mmap threshold (128 KiB at first, rising to what it has seen freed)
with a fresh mapping and unmaps it on free, so each of a long prefill's activations ([tokens, intermediate] in
bf16: megabytes, allocated again every layer) faults in its pages anew and the kernel zeroes them: tens of
thousands of page faults per 2k-token prefill. With the threshold at its maximum (32 MiB on 64-bit) and trimming
only past TRIM_BYTES, freed blocks stay in the heap and the next layer's tensors reuse them. The process keeps its
peak heap, which a serving process reaches again anyway. docs/benchmarks.md has the measurement.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_BYTES = 1 << 30  # free memory at the heap's top returned to the system only past this

_state: dict = {}


def keep_for_reuse() -> bool:
    """Sets glibc's thresholds once per process; False (and why, logged once) where the C library is not glibc."""
    if "ok" in _state:
        return _state["ok"]
    ok, why = False, ""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            why = "the C library is not glibc"
        else:
            ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
            why = "" if ok else "mallopt refused the thresholds"
    except OSError as e:
        why = str(e)
    _state["ok"] = ok
    if ok:
        log.info("heap: blocks up to %d MiB reused from the heap", MMAP_BYTES >> 20)
    else:
        log.warning("heap: glibc's thresholds not set (%s); large tensors are mapped afresh", why)
    return ok
