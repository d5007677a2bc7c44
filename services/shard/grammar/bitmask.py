"""Token masks as llguidance fills them ([rows, words] int32 bitmasks, bit t of a row = token t allowed) written
into a batch's scores: on CPU by packed-word index writes (`mask_rows`), elsewhere unpacked on the device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def mask_rows(
    logits: torch.Tensor, rows: Sequence[int], bits: np.ndarray, sparse_ok: set[int] | frozenset = frozenset()
) -> dict[int, np.ndarray]:
    """CPU: -inf at every id of `logits[rows[j]]` that bit row j of `bits` ([len(rows), words] uint32) does not
    allow; ids past the bitmask's width are never allowed.

    A bool masked_fill, or a [rows, vocab] torch.where, costs several plain passes over the scores on CPU: only the
    small side of each row is written. Where most ids are allowed (inside a JSON string) that is the blocked ids,
    set to -inf; where few are (JSON punctuation), the row becomes -inf and its allowed scores are put back. The
    side is chosen on the packed words (a popcount), the words of each row inverted or not so that one unpack
    gives every row's small side, and each row is then one or two index writes.

    A row of `sparse_ok` that allows few ids is not written at all: its allowed ids are returned ({row: ids})."""
    width = logits.shape[-1]
    few_allowed = 2 * np.bitwise_count(bits).sum(axis=1) < width
    small = np.where(few_allowed[:, None], bits, ~bits)  # per row: the bits of the ids to write
    # viewed as bool: flatnonzero reads bools faster than uint8
    unpacked = np.unpackbits(small.view(np.uint8), axis=1, bitorder="little").view(bool)[:, :width]
    beyond = 32 * bits.shape[1]  # ids past the bitmask (a model's padded vocabulary): never allowed
    # numpy's writes, single-threaded, cost far less than torch's index ops here (which also fan out to every core);
    # bf16 is written as its int16 bit patterns (numpy has no bf16): the kept scores are copied bit for bit
    scores, neg_inf = logits, float("-inf")
    if logits.dtype in (torch.float32, torch.float16):
        scores = logits.numpy()
    elif logits.dtype == torch.bfloat16:
        scores, neg_inf = logits.view(torch.int16).numpy(), BF16_NEG_INF
    sparse = {}
    for j, row in enumerate(rows):
        ids = np.flatnonzero(unpacked[j])
        if few_allowed[j] and row in sparse_ok:
            sparse[row] = ids
            continue
        if scores is logits:
            ids = torch.from_numpy(ids)
        line = scores[row]
        if few_allowed[j]:
            kept = line[ids]
            line[:] = neg_inf
            line[ids] = kept
        else:
            line[ids] = neg_inf
            if width > beyond:
                line[beyond:] = neg_inf
    return sparse


BF16_NEG_INF = np.int16(-128)  # 0xFF80: bf16's -inf, as an int16


def unpack(bits: np.ndarray, vocab: int, device: torch.device | str = "cpu", blocked: bool = False) -> torch.Tensor:
    """[rows, words] int32 bitmasks → [rows, vocab] bool: allowed (or, with `blocked`, not allowed) per token id.
    Token ids past the tokenizer's vocabulary are never allowed."""
    rows, words = bits.shape
    if torch.device(device).type == "cpu":
        packed = bits.view(np.uint8)
        flat = np.unpackbits(~packed if blocked else packed, axis=1, bitorder="little").view(bool)
        out = torch.from_numpy(flat)
    else:
        out = unpack_on(bits, device, blocked)
    if out.shape[1] >= vocab:
        return out[:, :vocab]
    pad = torch.full((rows, vocab - out.shape[1]), blocked, dtype=torch.bool, device=out.device)
    return torch.cat([out, pad], dim=1)


def unpack_on(bits: np.ndarray, device: torch.device | str, blocked: bool = False) -> torch.Tensor:
    """unpack's accelerator path: ship the packed words (32x smaller than the mask) and unpack on the device."""
    rows, words = bits.shape
    packed = torch.from_numpy(bits).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((packed[:, :, None] >> shifts) & 1).reshape(rows, words * 32) == (0 if blocked else 1)
