"""The chain hash of full KV blocks that the router and the scheduler share."""

import numpy as np

from libs.protocol.prefix_hash import extend_hashes, prefix_hashes


def prompt(seed, n=64):
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.int32)


def test_prefix_hashes_chain_full_blocks_only():
    a, b = prompt(0, 40), prompt(0, 40)
    b[35] += 1  # inside the partial third block: not hashed
    assert prefix_hashes(a, 16) == prefix_hashes(b, 16) and len(prefix_hashes(a, 16)) == 2
    c = a.copy()
    c[0] += 1  # the first block changes every chain hash after it
    assert not set(prefix_hashes(a, 16)) & set(prefix_hashes(c, 16))


def test_extending_a_chain_equals_hashing_it_at_once():
    ids = prompt(1, 100)
    grown = extend_hashes([], ids, 40, 16)  # as a sequence grows: two blocks, then the rest
    assert len(grown) == 2
    assert extend_hashes(grown, ids, len(ids), 16) == prefix_hashes(ids, 16) and len(grown) == 6
    assert prefix_hashes(ids, 8)[:2] != prefix_hashes(ids, 16)[:2]  # the block size is part of the key
