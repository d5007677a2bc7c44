"""The penalties, in TGI's order: watermark, repetition penalty, frequency penalty (TGI's logits processors).

They need each sequence's token ids so far (prompt and generated, as fed to the shard), so they run only on the
rows that ask for them; every other row is left untouched and costs nothing. Grammar is refused upstream.
"""

from __future__ import annotations

import numpy as np
import torch

from libs.protocol.params import SamplingParams

# Kirchenbauer et al.'s hash key, as TGI's `WatermarkLogitsProcessor`
WATERMARK_HASH_KEY = 15485863


def greenlist(prev_token: int, vocab_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """The watermark's green token ids after `prev_token`: the first gamma·V of a permutation seeded by it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(WATERMARK_HASH_KEY * int(prev_token))
    return torch.randperm(vocab_size, generator=gen, device=device)[: int(vocab_size * gamma)]


def token_counts(histories: list[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's history (one scatter for all rows)."""
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
    flat = torch.from_numpy(np.concatenate(histories).astype(np.int64, copy=False)).to(device)
    rows = torch.repeat_interleave(torch.arange(len(histories)), lengths).to(device)
    inside = flat < vocab_size  # an embedding-only id (beyond the LM head) can never be produced: not counted
    rows, flat = rows[inside], flat[inside]
    counts = torch.zeros(len(histories), vocab_size, dtype=torch.float32, device=device)
    return counts.index_put_((rows, flat), torch.ones(len(flat), device=device), accumulate=True)


def apply_penalties(
    scores: torch.Tensor,  # [n, vocab] float32, modified in place
    params: list[SamplingParams],
    histories: list[np.ndarray | None],  # per row: the sequence's token ids so far (None if not kept)
    *,
    gamma: float,
    delta: float,
) -> torch.Tensor:
    """Watermark → repetition penalty → frequency penalty on the rows that ask; returns `scores`."""
    vocab = scores.shape[-1]
    device = scores.device
    for i, p in enumerate(params):
        if p.watermark:  # a permutation per row: only watermarked rows pay for it
            scores[i, greenlist(int(histories[i][-1]), vocab, gamma, device)] += delta

    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0]
    if not rows:
        return scores
    hist = [histories[i] for i in rows]
    counts = token_counts(hist, vocab, device)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    sub = scores.index_select(0, index)
    rep = torch.tensor([params[i].repetition_penalty for i in rows], dtype=torch.float32, device=device)[:, None]
    # HF's RepetitionPenaltyLogitsProcessor: every id seen, prompt included, once whatever its count
    sub = torch.where(counts > 0, torch.where(sub < 0, sub * rep, sub / rep), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=torch.float32, device=device)[:, None]
    length = torch.tensor([len(h) for h in hist], dtype=torch.float32, device=device)[:, None]
    # TGI's frequency penalty: count / length of the ids, times the penalty
    sub = sub - counts / length * freq
    scores.index_copy_(0, index, sub)
    return scores
