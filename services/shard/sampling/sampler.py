"""Token choice, in TGI's order, as calls: logit_bias and the min_tokens mask (vLLM's, before its penalties);
penalties (watermark, repetition, frequency); the grammar mask (rows with a grammar only); warpers (temperature,
top-k, top-p, min-p, typical-p); the reduction (argmax and every logprob);
the seeded draws (per row with its generator, draws.py, or all rows in one call keyed by seed and position,
counter.py); the top-n alternatives. One file per stage beside this one. On CPU in half precision, a batch whose
scores are its logits over a temperature is reduced and drawn by the C++ kernel instead (fused.py).

Like TGI's `HeterogeneousNextTokenChooser`, a row samples when `do_sample` is set *or* any warper is active
(`SamplingParams.samples`), and the reported logprob is the log-softmax of the final processed and warped scores at
the chosen token; the alternatives come from that same distribution. A batch where no row changes its scores reads
the logits as they come (bf16 too: no float32 copy of them all). A greedy row whose grammar allows few tokens is
chosen among those alone (docs/structured-output.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from libs.protocol.params import SamplingParams
from services.shard.sampling import counter, fused
from services.shard.sampling.draws import draws
from services.shard.sampling.logit_bias import apply_logit_bias
from services.shard.sampling.min_tokens import mask_short
from services.shard.sampling.penalties import apply_penalties
from services.shard.sampling.reduction import choose_sparse, reduce, top_n
from services.shard.sampling.warpers import warp


@dataclass
class Choice:
    """One step's choice for n rows, on the logits' device."""

    token_ids: torch.Tensor  # [n] long
    logprobs: torch.Tensor  # [n] float32, log-softmax of the final scores at the chosen token
    # alternatives, or None when no row asked for any: per row how many, then all rows' ids/logprobs, best first
    top_counts: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def choose(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[np.ndarray | None] | None = None,  # per row: token ids so far, for rows with penalties
    *,
    watermark_gamma: float = 0.5,
    watermark_delta: float = 2.0,
    constrain: Callable[[torch.Tensor], None] | None = None,  # the grammar mask, see final_scores
    keys: counter.DrawKeys | None = None,  # every row's seed and draw position: sampled rows draw by counter.py
    lengths: list[int] | None = None,  # per row: the tokens before its pick (the min_tokens mask reads them)
    kernels: bool = False,  # the C++ kernels are loaded (CPU, half precision): fused.py may choose
) -> Choice:
    """Pick one token per row and report its logprob (and the alternatives asked for).

    Greedy rows take the argmax of their final scores; sampled rows a seeded draw (by inversion) from the softmax of
    theirs, each with its own generator (with `keys`: all at once, by the counter hash of seed and position, which
    draws other tokens than the generators do). Every logprob, the alternatives' too, is the score minus the row's
    logsumexp from the reduction."""
    n = logits.shape[0]
    device = logits.device
    if n == 0:
        return Choice(torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device))
    if kernels and keys is None and constrain is None and fused.takes(params):
        scores = logits  # alternatives are asked for on rows at temperature 1 only: their scores are the logits
        token_ids, maxes, spreads, picked = fused.choose(logits, params, generators)
    else:
        scores, token_ids, maxes, spreads, picked = by_stages(
            logits, params, generators, histories, watermark_gamma, watermark_delta, constrain, keys, lengths
        )
    choice = Choice(token_ids, (picked - maxes) - spreads)
    want = [p.top_n_tokens for p in params]
    if max(want) > 0:
        choice.top_counts, choice.top_ids, choice.top_logprobs = top_n(scores, maxes, spreads, want)
    return choice


def by_stages(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[np.ndarray | None] | None,
    watermark_gamma: float,
    watermark_delta: float,
    constrain: Callable[[torch.Tensor], None] | None,
    keys: counter.DrawKeys | None,
    lengths: list[int] | None,
) -> tuple[torch.Tensor, ...]:
    """`choose`'s stages in order: the final scores, the reduction, the draws. Returns the scores the tokens were
    chosen from, then per row the token, the max and logsumexp − max of its scores, and its score at the token."""
    n, device = logits.shape[0], logits.device
    scores, sparse = logits, {}
    if constrain is not None or any(p.keeps_history() or p.biases() or p.warps() for p in params):
        # greedy rows without alternatives may be chosen among their grammar's few allowed ids alone (CPU)
        plain = [i for i, p in enumerate(params) if not p.samples() and p.top_n_tokens == 0]
        scores, sparse = final_scores(
            logits,
            params,
            histories,
            watermark_gamma=watermark_gamma,
            watermark_delta=watermark_delta,
            constrain=constrain,
            sparse_ok=plain if constrain is not None and device.type == "cpu" else None,
            lengths=lengths,
        )
    token_ids, maxes, spreads = reduce(scores, [i for i in range(n) if i not in sparse] if sparse else None)
    if sparse:
        choose_sparse(scores, sparse, token_ids, maxes, spreads)
    drawn = [i for i, p in enumerate(params) if p.samples()]
    if drawn and keys is not None:
        at = torch.tensor(drawn, dtype=torch.long, device=device)
        token_ids[at] = counter.draw(scores.index_select(0, at), keys.select(drawn))
    elif drawn:
        token_ids[drawn] = draws(scores, drawn, generators)
    # greedy rows: the chosen score is the max, so the logprob is exactly −spread
    picked = scores.gather(1, token_ids[:, None])[:, 0].float()
    return scores, token_ids, maxes, spreads, picked


def final_scores(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    histories: list[np.ndarray | None] | None = None,
    *,
    watermark_gamma: float = 0.5,
    watermark_delta: float = 2.0,
    constrain: Callable[[torch.Tensor], None] | None = None,
    sparse_ok: list[int] | None = None,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, dict[int, np.ndarray]]:
    """The scores a row's token is chosen from — penalties, the grammar mask, then warpers — and the rows chosen
    among a few allowed ids ({row: ids}).

    The scores stay in the logits' own dtype where only the grammar mask changes them (masking bf16 in place writes
    -inf and keeps the rest bit for bit), else float32; `logits` itself is never written by the penalties or
    warpers, but `constrain` may mask it in place (the runner's own tensor, used for nothing else after the
    choice). With `sparse_ok` and a mask that can split (grammar.runner.GrammarMask), those rows that allow few
    tokens are left unmasked and their allowed ids returned: the caller chooses among them alone."""
    scores, sparse = logits, {}
    biased = any(p.biases() for p in params)
    if biased or any(p.keeps_history() for p in params):
        scores = logits.float()
        if scores is logits:  # the processors write in place: never into the caller's tensor
            scores = scores.clone()
    if biased:
        scores = mask_short(apply_logit_bias(scores, params), params, lengths)
    if any(p.keeps_history() for p in params):
        histories = histories or [None] * len(params)
        scores = apply_penalties(scores, params, histories, gamma=watermark_gamma, delta=watermark_delta)
    if constrain is not None:
        split = getattr(constrain, "split", None)
        if split is not None and sparse_ok:
            sparse = split(scores, sparse_ok)
        else:
            constrain(scores)
    if any(p.warps() for p in params):
        warped = scores.float()
        scores = warp(warped, params, in_place=warped is not logits)
    return scores, sparse
