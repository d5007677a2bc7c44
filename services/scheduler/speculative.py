"""Drafting for speculative decoding (`--speculate N`): prompt lookup, and the rule that turns it down by itself.

Prompt lookup (no draft model): a row's last n tokens (n = 3, then 2, then 1) are searched for in the row's own
prompt and output; the most recent earlier occurrence proposes the up-to-N tokens that followed it. Input-copying
work (editing code, quoting a document) finds long matches; free writing finds few, and most are wrong.

A draft must pay for the position it costs in the step's forward (attention, MLP, LM head, a pick). Per step:
- each row's drafts are worth what they are expected to add: with p the row's chance that a draft is accepted
  when the drafts before it were (RowStats: decayed counts of accepted and first-rejected drafts), its j-th draft
  adds p**j tokens;
- the step's time comes from a model fitted on the step results' `forward_s` (StepCost: fixed + per position,
  plus what verifying any draft at all costs, once and per row);
- drafts are taken best first, as many as give the most predicted tokens per second, and none unless that beats
  the same step without drafts. A batch of one on a CPU, whose step is mostly the weights' read, drafts freely;
  a large batch, whose step grows with every position, drafts only what is nearly sure, and free writing nothing;
- a row that is not drafting drifts back toward the prior (PRIOR_P), so that it is tried again where positions
  are cheap; a row whose acceptance is below PROBE_BELOW drafts only on a match of PROBE_NGRAM tokens or more;
- grammar-constrained rows never draft (a seam: drafts are not checked against the grammar's mask yet), and
  every draft fits the row's max_new_tokens (the bonus token included), the step's token budget and the KV
  blocks that are free without preempting anyone.
The shard's verification (services/shard/speculative.py) keeps outputs exactly what they would be without drafts.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up
PRIOR_P = 0.7  # a new row's chance that a draft is accepted (a copy often begins with a few misses)
PRIOR_WEIGHT = 2.0  # how many drafts' worth of evidence the prior is
DECAY = 0.8  # weight of a row's older evidence at each drafted step
REVERT = 0.97  # per step without drafts, a row's evidence shrinks toward the prior by this factor
PROBE_BELOW = 0.3  # below this acceptance a row drafts only on a match of PROBE_NGRAM tokens or more
PROBE_NGRAM = 2
FIXED_POSITIONS = 8.0  # prior of the step's time model: the fixed part of a step costs as much as 8 positions
PRIOR_STRENGTH = 4.0  # the prior slope counts as this much spread of positions (positions²) in the fit
RIDGE_DRAFTING = 0.5  # pull of the drafting terms toward 0 (one drafted step outweighs it)
WINDOW = 64  # decode steps in the time model


def lookup(tokens: np.ndarray, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> np.ndarray:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest matching suffix (of at
    least `min_ngram` tokens)."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n :]
        starts = np.flatnonzero(tokens[: size - n] == suffix[0])  # earlier starts: something follows each
        for j in range(1, n):
            starts = starts[tokens[starts + j] == suffix[j]]
        if len(starts):
            at = int(starts[-1]) + n
            return tokens[at : at + k]
    return tokens[:0]


class RowStats:
    """A row's drafting record (kept on the batcher's Sequence; not sequence state: a recompute keeps it).

    `accepted` and `rejected` are decayed counts of drafts accepted and of the first rejected draft of a step
    (drafts after it were never judged): p = accepted / (accepted + rejected) is the chance that a draft is
    accepted when the ones before it were."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        self.accepted = PRIOR_P * PRIOR_WEIGHT
        self.rejected = (1 - PRIOR_P) * PRIOR_WEIGHT

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepted = DECAY * self.accepted + accepted
            self.rejected = DECAY * self.rejected + (accepted < drafted)

    def idle(self) -> None:
        """A step without drafts: the record drifts back toward the prior."""
        self.accepted += (1 - REVERT) * (PRIOR_P * PRIOR_WEIGHT - self.accepted)
        self.rejected += (1 - REVERT) * ((1 - PRIOR_P) * PRIOR_WEIGHT - self.rejected)


class StepCost:
    """What a decode step's forward takes: t ≈ fixed + per_position × P + (drafting: once + per_row × R), fitted
    by least squares over the last WINDOW decode-only steps (P positions, R rows).

    The drafting terms are there because a step that verifies any draft runs a slower path than a plain decode
    step (measured on CPU: attention leaves its one-query fast path for every row, so the first draft of a step
    at 16 rows cost about as much as four more rows). They are pulled toward 0 and the slope toward the prior
    (the fixed part worth FIXED_POSITIONS positions), so the model answers before anything varied, a noisy
    machine cannot run it off, and once the drafted steps leave the window drafting is tried again."""

    def __init__(self) -> None:
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)  # (P, R, drafted, t)
        self._fit: np.ndarray | None = None  # [fixed, per position, drafting once, drafting per row]

    def observe(self, positions: int, rows: int, drafted: bool, seconds: float) -> None:
        self._rows.append((positions, rows, float(drafted), seconds))
        self._fit = None

    def model(self) -> np.ndarray | None:
        """[fixed, per position, drafting once, drafting per row] in seconds, or None before any step was timed."""
        if not self._rows:
            return None
        if self._fit is None:
            obs = np.asarray(self._rows)
            p, r, d, t = obs.T
            mt, mp = t.mean(), p.mean()
            x = np.stack([np.ones_like(p), p, d, d * r], 1)
            prior = np.array([0.0, mt / (FIXED_POSITIONS + mp), 0.0, 0.0])
            ridge = np.diag([0.0, PRIOR_STRENGTH, RIDGE_DRAFTING, RIDGE_DRAFTING])
            fit = np.linalg.solve(x.T @ x + ridge + 1e-9 * np.eye(4), x.T @ t + ridge @ prior)
            fit[1] = min(max(fit[1], 0.0), mt / mp)  # between free and "the step is all positions"
            fit[2:] = np.maximum(fit[2:], 0.0)
            fit[0] = max(fit[0], 0.0)
            self._fit = fit
        return self._fit

    def time(self, positions: int, rows: int, drafted: bool) -> float:
        """Predicted seconds of a decode step (relative units before any step was timed)."""
        m = self.model()
        if m is None:
            return FIXED_POSITIONS + positions
        return float(m[0] + m[1] * positions + drafted * (m[2] + m[3] * rows)) or 1e-9

    def per_position(self) -> float:
        m = self.model()
        return 1.0 if m is None else float(m[1])


class Drafter:
    def __init__(self, speculate: int) -> None:
        self.speculate = speculate
        self.cost = StepCost()
        self._planned: dict[int, tuple[int, int, bool]] = {}  # decode-only step → (positions, rows, drafted)
        self.gain = 0.0  # tokens/s with the last step's drafts over without, as the model predicted (tests, logs)

    def timed(self, step: int, forward_s: float) -> None:
        """A step's result came: a decode-only step's time goes into the model."""
        planned = self._planned.pop(step, None)
        if planned is not None and forward_s > 0:
            self.cost.observe(*planned, forward_s)
        if len(self._planned) > 64:  # steps that never came back (forgotten plans)
            self._planned.clear()

    def counts(self, rows: list, sampled: int, base_positions: int) -> dict[int, int]:
        """Row index → drafts it may propose: the best drafts first, as many as maximise the step's predicted
        tokens per second (none when no number of them beats the step without drafts)."""
        worth, owner = [], []
        for i, (s, n) in enumerate(rows):
            if n == 1 and s.computed + 1 == s.total and not s.req.grammar:  # a decode; grammar rows never draft
                room = min(self.speculate, s.req.max_new_tokens - len(s.output) - 1)
                p = s.drafting.acceptance
                worth += [p**j for j in range(1, room + 1)]
                owner += [i] * max(room, 0)
        self.gain = 0.0
        if not worth:
            return {}
        order = np.argsort(worth, kind="stable")[::-1]  # a row's j-th draft never comes before its (j-1)-th
        tokens = sampled + np.cumsum(np.asarray(worth)[order])
        k = np.arange(1, len(order) + 1)
        m, cost = self.cost.model(), self.cost
        if m is None:
            times = FIXED_POSITIONS + base_positions + k
        else:
            times = m[0] + m[1] * (base_positions + k) + m[2] + m[3] * len(rows)
        rates = tokens / times
        best = int(np.argmax(rates))
        plain = sampled / cost.time(base_positions, len(rows), False)
        self.gain = float(rates[best] / plain) if plain > 0 else 0.0
        if self.gain <= 1.0:
            return {}
        out: dict[int, int] = {}
        for j in order[: best + 1].tolist():
            out[owner[j]] = out.get(owner[j], 0) + 1
        return out

    def draft(self, batcher, rows: list, step: int = 0) -> dict[int, list[int]]:
        """Row index → drafts, for the decode rows of a planned step that may draft, within the step's leftover
        token budget and the blocks free without preempting anyone (grown here for the drafts)."""
        base = sum(n for _, n in rows)
        sampled = sum(s.computed + n == s.total for s, n in rows)
        wants = self.counts(rows, sampled, base)
        budget = batcher.max_batch_prefill_tokens - base
        out, bs, allocator = {}, batcher.block_size, batcher.allocator
        for i, (s, n) in enumerate(rows):
            if i not in wants:
                if n == 1 and s.computed + 1 == s.total:
                    s.drafting.idle()
                continue
            held = len(s.blocks) * bs - (s.computed + 1)  # slots its blocks hold past the fed token
            spare = max(0, allocator.free - batcher.watermark) * bs
            drafts = self.propose(s.tokens(0, s.total), min(wants[i], budget, held + spare), s.drafting)
            if not drafts:
                s.drafting.idle()
                continue
            need = -(-(s.computed + 1 + len(drafts)) // bs) - len(s.blocks)
            if need > 0:
                s.blocks += allocator.allocate(need)
            out[i] = drafts
            budget -= len(drafts)
            batcher.counters["draft_tokens"] += len(drafts)
        if sampled == len(rows) and base == len(rows):  # decode-only: its time teaches the model
            self._planned[step] = (base + sum(len(d) for d in out.values()), len(rows), bool(out))
        return out

    def propose(self, tokens: np.ndarray, k: int, stats: RowStats) -> list[int]:
        """The row's drafts (at most k), from prompt lookup over its tokens."""
        if k <= 0:
            return []
        probe = stats.acceptance < PROBE_BELOW
        return lookup(tokens, k, min_ngram=PROBE_NGRAM if probe else 1).tolist()
