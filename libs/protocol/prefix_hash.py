"""Chain hashes of full KV blocks: the key of a replica's prefix index (services/scheduler/block_allocator.py)
and of the router's prefix affinity (services/router/placement.py).

The hash of block i covers the token ids of blocks 0..i, so equal hashes mean equal prefixes, and hence equal KV
(positions and every earlier token included). Router and scheduler hash with this one function, so a router that
sends a prompt to the replica holding its prefix sends it where the hit is.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chain_hash(previous: bytes, block_ids: np.ndarray) -> bytes:
    """The hash of one full block given the hash of the blocks before it (b"" for the first block)."""
    return hashlib.blake2b(previous + np.ascontiguousarray(block_ids, dtype="<i4").tobytes(), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], ids: np.ndarray, upto: int, block_size: int) -> list[bytes]:
    """Append to `hashes` (the chain of `ids`' first full blocks) the hashes of every full block within ids[:upto]."""
    for start in range(len(hashes) * block_size, upto - block_size + 1, block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else b"", ids[start : start + block_size]))
    return hashes


def prefix_hashes(ids: np.ndarray, block_size: int) -> list[bytes]:
    """Chain hashes of every full block of `ids`, shortest prefix first."""
    return extend_hashes([], ids, len(ids), block_size)
