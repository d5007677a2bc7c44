"""Token choice, in TGI's order: temperature, top-k, top-p; then a seeded draw or argmax.

Like TGI's `NextTokenChooser`, a row samples when `do_sample` is set *or* any warper is active (a request with
only `temperature=0.7` samples), and the reported logprob is the log-softmax of the *warped* scores at the
chosen token. Rows without warpers and without `do_sample` are greedy: argmax of the raw logits.

The warpers run on all rows at once (a neutral row is a no-op); only the draw is per row, because every
request owns its generator (same seed → same tokens, whatever else shares the batch).
"""

from __future__ import annotations

import torch

from libs.protocol.messages import SamplingParams


def _has_warpers(p: SamplingParams) -> bool:
    return p.temperature != 1.0 or p.top_k > 0 or p.top_p < 1.0


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply each row's temperature, top-k and top-p (HF/TGI warper semantics); removed tokens become -inf."""
    scores = logits.float()
    device = scores.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    if bool((temperature != 1.0).any()):
        scores = scores / temperature[:, None]

    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    if bool((top_k > 0).any()):
        # TopKLogitsWarper: drop scores strictly below the k-th largest (ties at the k-th survive)
        k = top_k.clamp(1, scores.shape[-1])
        kth = torch.sort(scores, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        remove = (scores < kth) & (top_k > 0)[:, None]
        scores = scores.masked_fill(remove, float("-inf"))

    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    if bool((top_p < 1.0).any()):
        # TopPLogitsWarper: ascending sort, drop the low tail whose cumulative mass is <= 1 - top_p,
        # always keeping the best token
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum <= (1.0 - top_p)[:, None]
        sorted_remove[:, -1] = False
        sorted_remove &= (top_p < 1.0)[:, None]
        remove = sorted_remove.scatter(1, order, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def sample(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (token_ids [n] long, logprobs [n] float32) on the logits' device."""
    if logits.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device), torch.zeros(0, device=logits.device)
    scores = warp(logits, params)
    logprobs = torch.log_softmax(scores, dim=-1)
    token_ids = torch.argmax(logits, dim=-1)  # greedy rows: argmax of the raw logits
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.do_sample or _has_warpers(p):
            probs = torch.softmax(scores[i], dim=-1)
            token_ids[i] = torch.multinomial(probs, num_samples=1, generator=gen)[0]
    return token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0]
