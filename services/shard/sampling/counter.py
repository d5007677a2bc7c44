"""Counter-based seeded draws: every sampled row drawn in one batched call, keyed by (seed, position), with no
torch.Generator, so a GPU draws a whole batch in a fixed number of launches instead of one per row.

Each (seed, position, token id) hashes to a 32-bit integer (murmur3's fmix32 finalizer, rounds keyed by a 64-bit
row key mixed from the seed and the position), computed with torch integer ops on int64 tensors that only ever
hold values below 2^49 (32 × 16-bit products, masks, right shifts of non-negative values: no signed overflow),
so the integers are bit for bit the same on every device. The integer becomes a uniform in (0,1) strictly, then
Exponential noise E = −log(1 − u), and the row's token is argmax(scores − log E): the Gumbel-max trick, an exact
draw from softmax(scores) whatever the other rows are (−inf scores stay −inf and are never drawn). A token's
draw depends on its row's scores, seed and position only, not on the batch, the row order or the device (up to
a last-ulp difference in `log` between devices deciding a near tie). Not the generator path's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MASK32 = 0xFFFF_FFFF
# Elements of one chunk of rows hashed together: on CPU about 8 MB of int64 temporaries, which stay in cache
# (the fastest measured); on a GPU few launches matter more (256 MB temporaries).
CHUNK_ELEMENTS = 1 << 20
CUDA_CHUNK_ELEMENTS = 1 << 25


@dataclass
class DrawKeys:
    """Per row: the request's seed (its 64 bits as a signed int64) and the position of the token it draws."""

    seeds: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64

    @classmethod
    def of(cls, seeds: Sequence[int], positions: Sequence[int] | np.ndarray, device: torch.device) -> DrawKeys:
        """Keys from Python seeds (any int: its low 64 bits are kept) and positions, on `device`."""
        signed = [((int(s) & 0xFFFF_FFFF_FFFF_FFFF) ^ (1 << 63)) - (1 << 63) for s in seeds]
        return cls(
            torch.tensor(signed, dtype=torch.int64, device=device),
            torch.as_tensor(np.asarray(positions, dtype=np.int64), device=device),
        )

    def select(self, rows: list[int]) -> DrawKeys:
        where = torch.tensor(rows, dtype=torch.long, device=self.seeds.device)
        return DrawKeys(self.seeds[where], self.positions[where])


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for x in [0, 2^32) and a 32-bit constant, as two 16-bit partial products (< 2^48 each);
    a new tensor (x is left as it was)."""
    lo, hi = c & 0xFFFF, c >> 16
    high = (x * hi).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return (x * lo).add_(high).bitwise_and_(MASK32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer: a bijection of [0, 2^32) with full avalanche (h itself is overwritten)."""
    h.bitwise_xor_(h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def _chain(start: int, words: list[torch.Tensor]) -> torch.Tensor:
    h = _fmix32(torch.full_like(words[0], start))
    for w in words:
        h = _fmix32((h + w) & MASK32)
        h = _fmix32(h ^ w)
    return h


def row_keys(keys: DrawKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit words per row mixed from (seed, position), [rows] int64 each."""
    s, p = keys.seeds.to(torch.int64), keys.positions.to(torch.int64)
    words = [s & MASK32, (s >> 32) & MASK32, p & MASK32, (p >> 32) & MASK32]  # >> then mask: the two's complement bits
    return _chain(0x243F6A88, words), _chain(0x13198A2E, words)


def hash_bits(keys: DrawKeys, vocab: int) -> torch.Tensor:
    """[rows, vocab] int64 in [0, 2^32): the hash of (seed, position, token id); for one row a bijection of ids."""
    k0, k1 = row_keys(keys)
    ids = torch.arange(vocab, dtype=torch.int64, device=k0.device)[None]
    x = _fmix32(ids ^ k0[:, None])
    x = _fmix32(x.add_(k1[:, None]).bitwise_and_(MASK32))
    return _fmix32(x.bitwise_xor_(k0[:, None]))


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit integers → float32 in (0,1) strictly: (bits + ½) / 2^32, rounded to float32 (exact near 0, where a
    draw's winner is decided) and kept at most 1 − 2^-24 (the largest float32 below 1)."""
    u = (bits.to(torch.float32) + 0.5) * 2.0**-32
    return u.clamp_(max=1.0 - 2.0**-24)


def uniforms(keys: DrawKeys, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 in (0,1) strictly, one per (row's seed and position, token id)."""
    return to_uniform(hash_bits(keys, vocab))


def draw(scores: torch.Tensor, keys: DrawKeys) -> torch.Tensor:
    """One token per row of `scores` ([rows, vocab], any float dtype): an exact draw from softmax(row) keyed by
    the row's (seed, position); [rows] long on the scores' device."""
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.long, device=scores.device)
    per = CUDA_CHUNK_ELEMENTS if scores.device.type == "cuda" else CHUNK_ELEMENTS
    chunk = max(1, per // max(vocab, 1))
    for start in range(0, rows, chunk):
        part = slice(start, min(start + chunk, rows))
        u = uniforms(DrawKeys(keys.seeds[part], keys.positions[part]), vocab)
        noise = torch.log1p(u.neg_()).neg_().log_()  # log E, E = −log(1 − u) ~ Exp(1), finite and > 0
        out[part] = (scores[part].float() - noise).argmax(dim=-1)
    return out
