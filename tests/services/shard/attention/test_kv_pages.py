"""The KV cache's memory: zeroed pages on first touch, made resident by a thread at idle priority, in the order the
allocator hands blocks out, without losing what steps wrote meanwhile."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import torch

from services.shard.attention import kv_pages


def _resident_pages(t: torch.Tensor) -> int:
    """How many pages of `t`'s (page-aligned) memory are resident (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    nbytes = t.numel() * t.element_size()
    vec = ctypes.create_string_buffer(-(-nbytes // mmap.PAGESIZE))
    assert libc.mincore(t.data_ptr(), nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def test_the_kv_cache_is_made_resident_beside_the_start_and_keeps_what_steps_wrote():
    shape = (2, 256, 16, 64)  # 1 MiB of bf16 each for K and V
    pages = len(range(0, 2 * 256 * 16 * 64 * 2, mmap.PAGESIZE))
    ((k, v),) = kv_pages.allocate_pages(1, shape, torch.bfloat16, torch.device("cpu"))[0]
    assert _resident_pages(k) == 0  # without prefault: pages on first touch
    k[1, 7] = 1.5  # a step's write: populating keeps it
    assert _resident_pages(k) == 1
    kv_pages.populate([k, v]).join(timeout=60)  # idle priority: waits for a free core
    assert _resident_pages(k) == _resident_pages(v) == pages
    assert (k[1, 7] == 1.5).all() and k.float().abs().sum() == 1.5 * 16 * 64 and v.float().abs().sum() == 0

    ((k, v),) = kv_pages.allocate_pages(1, shape, torch.bfloat16, torch.device("cpu"), prefault=True)[0]
    deadline = time.monotonic() + 60  # the thread runs at idle priority: on a busy machine it waits for a core
    while _resident_pages(v) < pages and time.monotonic() < deadline:  # the thread's work, polled
        time.sleep(0.01)
    assert _resident_pages(k) == _resident_pages(v) == pages


def test_blocks_are_populated_in_the_order_the_allocator_hands_them_out():
    """Every tensor's and head's first blocks come before any tensor's later ones, and the ranges cover it all."""
    shape = (3, 40, 16, 64)  # 2 KiB blocks: two to a page; 3 heads
    tensors = [kv_pages._zeros(shape, torch.bfloat16, torch.device("cpu")) for _ in range(4)]
    block_bytes = 16 * 64 * 2
    got = kv_pages.ranges(tensors, chunk_bytes=8 * block_bytes)
    assert len(got) == 5 * 4 * 3  # 40 blocks in chunks of 8, per tensor and head
    first = got[: 4 * 3]  # the first chunk: blocks 0-7 of every tensor and head
    assert sorted(a for a, _ in first) == sorted(t[h, 0].data_ptr() for t in tensors for h in range(3))
    for address, length in got:
        assert address % mmap.PAGESIZE == 0 and length >= 8 * block_bytes
    for t in tensors:  # the union covers every byte of every tensor
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        covered = sorted((a, a + n) for a, n in got if lo <= a < hi)
        reach = lo
        for a, b in covered:
            assert a <= reach
            reach = max(reach, b)
        assert reach >= hi


def test_the_populating_thread_runs_at_idle_priority():
    """SCHED_IDLE: the thread takes only CPU time no step wants (seen from outside while it works)."""
    shape = (1, 256, 16, 256)  # 4 MiB of float32 for K and V each: ~2,000 faults, long enough to be seen
    tensors = [kv_pages._zeros(shape, torch.float32, torch.device("cpu")) for _ in "kv"]
    thread = kv_pages.populate(tensors)
    seen = set()
    while thread.is_alive() and os.SCHED_IDLE not in seen:
        try:
            seen.add(os.sched_getscheduler(thread.native_id))
        except OSError:  # the thread ended between the check and the call
            break
        time.sleep(0.001)  # a core left free: the thread runs only on idle time
    thread.join(timeout=60)
    assert os.SCHED_IDLE in seen
