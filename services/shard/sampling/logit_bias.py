"""OpenAI's logit_bias: a per-row map of token id → bias added to that token's logit, before the penalties (as vLLM
applies it). The tokenizer has checked the ids against the vocabulary and the biases against -100…100; +100 makes
the token win against any ordinary logit and -100 makes it lose, but both stay finite, as in OpenAI and vLLM."""

from __future__ import annotations

import torch

from libs.protocol.params import SamplingParams


def apply_logit_bias(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add each row's biases to `scores` ([n, vocab] float32, in place) in one scatter; returns `scores`."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            rows.append(i)
            ids.append(int(token))
            values.append(float(bias))
    if rows:
        device = scores.device
        index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
        scores.index_put_(index, torch.tensor(values, dtype=scores.dtype, device=device), accumulate=True)
    return scores
