"""The paged KV cache's memory: per layer a (K, V) pair of head-major tensors [kv_heads, blocks, block_size, D], on
CPU in anonymous mappings the kernel zeroes on first touch, and made resident beside the shard's start.

A first touch costs a fault per 4 KiB page; left to the steps, every prefill that reaches new blocks pays them until
the whole cache has been used once. `populate` pays them once, on a thread of its own, at the lowest CPU priority
(SCHED_IDLE): it takes only the time no step wants, so a server loaded from its first second serves at full speed
while its cache fills (its steps fault in the blocks the thread has not reached), and it goes in the order the
scheduler's allocator hands blocks out (lowest index first), so the blocks the first requests take are resident
first. docs/attention.md tells what each choice measured.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): the range's pages faulted in writable, their contents untouched
MADV_POPULATE_WRITE = 23
# Bytes of one tensor populated per call: the GIL and the address space's lock are taken once a call, so a step's own
# faults or mappings never wait long behind the thread (Linux takes that lock for the whole call)
CHUNK_BYTES = 1 << 20


def allocate_pages(
    layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, prefault: bool = False
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The paged KV cache: per layer (K, V), zeroed, each `shape` = [kv_heads, blocks, block_size, D] (head-major:
    gathering a row's blocks gives each head's keys as one contiguous matrix), and the same as [kv_heads, slots, D]
    views (where a step's new K/V go in), formed once. `prefault` (Settings.kv_prefault): on CPU, every page made
    resident by a thread beside the shard's start (`populate`), so that no step pays for its blocks' first touch."""
    pages = [tuple(_zeros(shape, dtype, torch.device(device)) for _ in "kv") for _ in range(layers)]
    flat = [tuple(t.view(shape[0], -1, shape[3]) for t in kv) for kv in pages]
    if prefault and torch.device(device).type == "cpu":
        populate([t for kv in pages for t in kv])
    return pages, flat


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU in an anonymous mapping, whose pages the kernel hands out zeroed on first touch, so
    a cache of gigabytes costs nothing until its blocks are used (torch.zeros writes every page at start:
    docs/attention.md). Page-aligned; the mapping lives as long as the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def ranges(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(address, length) of page-aligned ranges covering `tensors` ([kv_heads, blocks, ...] each, contiguous), in
    the order blocks are handed out: blocks [0, n) of every tensor and head, then [n, 2n), ..., with n blocks in about
    `chunk_bytes`. A range starts on the page holding its first byte, so a page two ranges share comes twice (the
    second call finds it resident)."""
    heads, blocks = tensors[0].shape[:2]
    block_bytes = tensors[0][0, 0].numel() * tensors[0].element_size()
    step = max(1, chunk_bytes // block_bytes)
    out = []
    for first in range(0, blocks, step):
        span = (min(first + step, blocks) - first) * block_bytes
        for t in tensors:
            for h in range(heads):
                start = t[h, first].data_ptr()
                aligned = start - start % mmap.PAGESIZE
                out.append((aligned, start + span - aligned))
    return out


def populate(tensors: list[torch.Tensor]) -> threading.Thread:
    """Make the pages of `tensors` (page-aligned CPU mappings of the cache's shape, as `_zeros` gives) resident, on
    a thread of its own under SCHED_IDLE (on CPU time no other thread of the machine wants), in `ranges`' order.
    MADV_POPULATE_WRITE leaves what is written untouched, so steps may write K/V meanwhile; each call releases the
    GIL (ctypes). Where the kernel lacks it, pages stay on first touch (logged). Returns the thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    todo = ranges(tensors)

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except (AttributeError, OSError) as e:  # not Linux, or a sandbox that forbids it: normal priority
            log.info("KV cache: populating at normal priority (%s)", e)
        started = time.perf_counter()
        for address, length in todo:
            if libc.madvise(address, length, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                log.warning("KV cache: pages on first touch (madvise POPULATE_WRITE: %s)", os.strerror(err))
                return
        mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        log.info("KV cache: %.0f MiB resident in %.1f s", mib, time.perf_counter() - started)

    thread = threading.Thread(target=run, name="kv-populate", daemon=True)
    thread.start()
    return thread
