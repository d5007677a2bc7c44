"""Chain hashes of full KV blocks: the key of a replica's prefix index (services/scheduler/block_allocator.py)
and of the router's prefix affinity (services/router/placement.py).

The hash of block i covers the token ids of blocks 0..i, so equal hashes mean equal prefixes, and hence equal KV
(positions and every earlier token included). Router and scheduler hash with this one function, so a router that
sends a prompt to the replica holding its prefix sends it where the hit is.

KV depends on the LoRA adapter a sequence runs with, so the chain starts from a seed naming the adapter
(`adapter_seed`): a base-model prefix never serves an adapter's request, nor one adapter's another's.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chain_hash(previous: bytes, block_ids: np.ndarray, extra: bytes = b"") -> bytes:
    """The hash of one full block given the hash of the blocks before it (b"" for the first block); `extra`: the
    content digests of the images whose placeholder tokens the block holds."""
    ids = np.ascontiguousarray(block_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(previous + ids + extra, digest_size=16).digest()


def adapter_seed(adapter: str | None) -> bytes:
    """What the first block's hash chains from: b"" for the base model, a digest of the name for an adapter."""
    return b"" if not adapter else hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=16).digest()


def extend_hashes(
    hashes: list[bytes], ids: np.ndarray, upto: int, block_size: int, adapter: str | None = None, images=()
) -> list[bytes]:
    """Append to `hashes` (the chain of `ids`' first full blocks) the hashes of every full block within ids[:upto].

    `images` (ImageInput-like: digest, start, tokens): a vision model's placeholder tokens are the same ids for
    every image, so a block holding some of an image's placeholders hashes that image's digest too (the same
    placeholders with another image never hit; the same image does)."""
    for start in range(len(hashes) * block_size, upto - block_size + 1, block_size):
        end = start + block_size
        extra = b"".join(bytes.fromhex(im.digest) for im in images if im.start < end and start < im.start + im.tokens)
        hashes.append(chain_hash(hashes[-1] if hashes else adapter_seed(adapter), ids[start:end], extra))
    return hashes


def prefix_hashes(ids: np.ndarray, block_size: int, adapter: str | None = None, images=()) -> list[bytes]:
    """Chain hashes of every full block of `ids`, shortest prefix first."""
    return extend_hashes([], ids, len(ids), block_size, adapter, images)
