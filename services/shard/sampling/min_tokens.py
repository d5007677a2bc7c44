"""min_tokens (vLLM's; transformers' MinNewTokensLengthLogitsProcessor): while a sequence is shorter than its
`min_length` (prompt length + min_tokens, resolved by the tokenizer), the ids that would end it (EOS unless
ignore_eos, and stop_token_ids) get -inf. A pick's length is its draw position (the tokens before it), so a drafted
row's picks and a recomputed sequence are masked by where they stand, not by how they got there."""

from __future__ import annotations

import torch

from libs.protocol.params import SamplingParams


def mask_short(scores: torch.Tensor, params: list[SamplingParams], lengths: list[int] | None) -> torch.Tensor:
    """-inf at each short row's `min_length_ids` (`scores` [n, vocab] float32, in place); `lengths`: per row, the
    tokens before its pick (None: no row is masked). Returns `scores`."""
    if lengths is None:
        return scores
    rows, ids = [], []
    for i, (p, length) in enumerate(zip(params, lengths)):
        if length < p.min_length:
            rows.extend([i] * len(p.min_length_ids))
            ids.extend(p.min_length_ids)
    if rows:
        device = scores.device
        scores[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = float("-inf")
    return scores
