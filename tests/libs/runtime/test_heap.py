"""The shard's heap kept for reuse (libs/runtime/heap.py): after `keep_for_reuse`, a 64 MiB block (larger than
glibc's largest mmap threshold) comes from the heap, where glibc's default maps it afresh, and, freed, stays at the
heap's top for the next one instead of going back to the system; `release` gives it back. Each case runs in a
process of its own (the thresholds are process-wide); glibc's own counters (mallinfo2) say where the block went."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, sys
from libs.runtime import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert heap.keep_for_reuse() and heap.keep_for_reuse()  # set once; a second call repeats the answer
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
kept = libc.mallinfo2().keepcost
heap.release()
print(json.dumps({"mapped": mapped, "kept": kept, "released": libc.mallinfo2().keepcost}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="the C library is not glibc"
)  # checked without setting anything in this process
def test_a_large_block_comes_from_the_heap_and_stays_there():
    default, kept = _probe("default"), _probe("keep")
    assert default["mapped"] == 1 and default["kept"] < 64 << 20  # mapped afresh, unmapped on free
    assert kept["mapped"] == 0 and kept["kept"] >= 64 << 20  # from the heap, kept at its top for the next
    assert kept["released"] < 1 << 20  # malloc_trim gave it back
