"""Prompt logprobs (TGI's `decoder_input_details` prefill): the logprob of every fed prompt token given the
tokens before it, from the RAW logits (log-softmax, no processors or warpers).

The logits at position j predict token j + 1, so a chunk of n fed tokens needs the LM head on all n of its
positions: n - 1 of them score the chunk's own next tokens, and the last one scores the first token of the NEXT
chunk. That row is kept (as a log-softmax over the vocabulary) until the next chunk comes, so chunked prefill
reports the same numbers as one prefill. The very first token of a sequence has no logprob: NaN, as TGI.
"""

from __future__ import annotations

import torch

# positions scored at once: bounds the float32 copy of [positions, vocab] logits (a bf16 262k-vocab model
# would otherwise copy 1 MiB per prompt token at once)
_CHUNK = 256


def chunk_logprobs(
    logits: torch.Tensor,  # [n, vocab]: the raw logits at each fed position of the chunk
    tokens: torch.Tensor,  # [n] long: the fed tokens
    carried: torch.Tensor | None,  # [vocab] log-softmax at the previous chunk's last position, or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [n] float32 of the fed tokens, log-softmax [vocab] at the last position for the next chunk)."""
    n = tokens.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    out[0] = float("nan") if carried is None else carried[tokens[0]]
    for start in range(0, n - 1, _CHUNK):
        end = min(start + _CHUNK, n - 1)
        rows = logits[start:end].float()
        picked = rows.gather(-1, tokens[start + 1 : end + 1, None])[:, 0]
        out[start + 1 : end + 1] = picked - torch.logsumexp(rows, dim=-1)
    return out, torch.log_softmax(logits[n - 1].float(), dim=-1)


def chunk_greedy(
    logits: torch.Tensor,  # [n, vocab]: the raw logits at each fed position of the chunk
    carried: torch.Tensor | None,  # [vocab] log-softmax at the previous chunk's last position, or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy token at each fed position and its logprob (ids [n] int32, logprobs [n] float32): what the raw
    distribution before each fed token ranks first (OpenAI's prompt `top_logprobs`). The first token of a
    sequence has none: id -1, NaN."""
    n = logits.shape[0]
    ids = torch.full((n,), -1, dtype=torch.int32, device=logits.device)
    out = torch.full((n,), float("nan"), dtype=torch.float32, device=logits.device)
    if carried is not None:
        best = carried.argmax()
        ids[0], out[0] = best.to(torch.int32), carried[best]
    for start in range(0, n - 1, _CHUNK):
        end = min(start + _CHUNK, n - 1)
        rows = logits[start:end].float()
        top, best = rows.max(dim=-1)
        ids[start + 1 : end + 1] = best.to(torch.int32)
        out[start + 1 : end + 1] = top - torch.logsumexp(rows, dim=-1)
    return ids, out
