"""The warpers, in TGI's order: temperature, top-k, top-p, min-p (transformers' place for it), typical-p (HF/TGI
semantics; removed tokens become -inf). Each is per row, so a row's result is the same whatever shares the batch;
only the rows that have a warper are warped."""

from __future__ import annotations

import torch

from libs.protocol.params import SamplingParams


def warp(scores: torch.Tensor, params: list[SamplingParams], *, in_place: bool) -> torch.Tensor:
    """The warped float32 `scores`, run on the rows that have a warper only: neutral rows in a mixed batch cost no
    division, top-k or sort. `in_place`: the scores are the caller's own copy and may take the warped rows."""
    active = [i for i, p in enumerate(params) if p.warps()]
    if len(active) == len(params):
        return warp_all(scores, params)
    if not active:
        return scores
    rows = torch.tensor(active, device=scores.device)
    warped = warp_all(scores.index_select(0, rows), [params[i] for i in active])
    return (scores if in_place else scores.clone()).index_copy_(0, rows, warped)


def warp_all(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Every row's warpers, all rows at once."""
    device = scores.device
    temperature = [p.temperature for p in params]
    if any(t != 1.0 for t in temperature):
        scores = scores / torch.tensor(temperature, dtype=torch.float32, device=device)[:, None]

    if any(p.top_k > 0 for p in params):
        # TopKLogitsWarper: drop scores strictly below the k-th largest (ties at the k-th survive)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        k = top_k.clamp(1, scores.shape[-1])
        widest = min(max(max(p.top_k for p in params), 1), scores.shape[-1])  # k.max(), without a device sync
        kth = torch.topk(scores, widest, dim=-1).values.gather(-1, (k - 1)[:, None])
        scores = scores.masked_fill((scores < kth) & (top_k > 0)[:, None], float("-inf"))

    if any(p.top_p < 1.0 for p in params):
        # TopPLogitsWarper: ascending sort, drop the low tail whose cumulative mass is <= 1 - top_p,
        # always keeping the best token
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum <= (1.0 - top_p)[:, None]
        sorted_remove[:, -1] = False
        sorted_remove &= (top_p < 1.0)[:, None]
        scores = scores.masked_fill(sorted_remove.scatter(1, order, sorted_remove), float("-inf"))

    if any(p.min_p > 0.0 for p in params):
        # MinPLogitsWarper: drop tokens whose probability is below min_p times the best one's (the best stays)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        probs = scores.softmax(dim=-1)
        remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(1, scores.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, float("-inf"))

    if any(p.typical_p < 1.0 for p in params):
        mass = torch.tensor([p.typical_p for p in params], dtype=torch.float32, device=device)
        scores = typical(scores, mass, mass < 1.0)
    return scores


def typical(scores: torch.Tensor, mass: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """HF/TGI's TypicalLogitsWarper per row: keep the tokens whose surprise is closest to the entropy."""
    normalized = torch.log_softmax(scores, dim=-1)
    probs = normalized.exp()
    entropy = -(normalized * probs).nansum(-1, keepdim=True)  # -inf * 0 = nan: removed tokens add nothing
    shifted = (-normalized - entropy).abs()
    sorted_shifted, order = torch.sort(shifted, dim=-1, descending=False)
    cum = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass[:, None]).sum(dim=1).clamp_(max=scores.shape[-1] - 1)
    sorted_remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    sorted_remove[:, 0] = False  # min_tokens_to_keep = 1
    sorted_remove &= active[:, None]  # mass 1.0 rows: float rounding must not cut them
    return scores.masked_fill(sorted_remove.scatter(1, order, sorted_remove), float("-inf"))
