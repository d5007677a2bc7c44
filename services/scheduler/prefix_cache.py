"""Chain hashes of full KV blocks: the key of the prefix cache (and of the router's prefix affinity).

The hash of block i covers the token ids of blocks 0..i, so equal hashes mean equal prefixes, and hence equal KV
(positions and every earlier token included). Same function as `services.router.placement.prefix_hashes`, so a
router that sends a prompt to the replica holding its prefix sends it where the hit is.
"""

from __future__ import annotations

import hashlib

import numpy as np

from libs.runtime.settings import BLOCK_SIZE


def chain_hash(previous: bytes, block_ids: np.ndarray) -> bytes:
    """The hash of one full block given the hash of the blocks before it (b"" for the first block)."""
    return hashlib.blake2b(previous + np.ascontiguousarray(block_ids, dtype="<i4").tobytes(), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], ids: np.ndarray, upto: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Append to `hashes` (the chain of `ids`' first full blocks) the hashes of every full block within ids[:upto]."""
    for start in range(len(hashes) * block_size, upto - block_size + 1, block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else b"", ids[start : start + block_size]))
    return hashes
