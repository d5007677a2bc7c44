"""Drafting for speculative decoding (`--speculate N`): prompt lookup, and the rule that turns it down by itself.

Prompt lookup (no draft model): a row's last n tokens (n = 3, then 2, then 1) are looked up in its own prompt and
output (`PromptIndex`, grown as the row appends), and the most recent earlier occurrence proposes the up-to-N tokens
that followed it. A j-th draft is worth p**j tokens, p the acceptance of its match-length class over every row
(`MatchStats`, greedy and sampled apart) times the row's own record (`RowStats`); a drafted position's price comes
from decode-only steps' `forward_s`, fitted per batch size (`StepCost`). `Drafter.choose` weighs only drafts worth
(1 + MARGIN) times their position's cost, takes the best, as many as give the most predicted tokens per second, and
none unless that beats the plain step by GAIN_MARGIN. Drafts fit the row's max_new_tokens; the batcher trims them to
its token budget and free KV blocks. Grammar-constrained rows draft too, and the shard's verification
(services/shard/verify.py) keeps outputs what they would be without drafts. docs/speculative-decoding.md tells why.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up
MAX_MATCH = 16  # a match's length is counted back this far
# match length classes: 1, 2, 3, 4-7, 8-15, 16+ tokens; and each one's prior acceptance, on the low side of what
# copying reaches (a class is learnt from its first drafts; where positions are dear it may never be tried)
LENGTH_CLASSES = (1, 2, 3, 4, 8, 16)
PRIOR_P = (0.2, 0.4, 0.6, 0.75, 0.85, 0.9)
PRIOR_WEIGHT = 4.0  # how many drafted rows' worth of evidence a class's prior is
CLASS_DECAY = 0.995  # weight of a class's older evidence at each drafted row
MAX_P = 0.98  # no draft is ever sure
ROW_DECAY = 0.8  # weight of a row's older record at each drafted step
ROW_PRIOR = 1.0  # the row's record starts as this many drafts that did as predicted
REVERT = 0.97  # per step without drafts, a row's record shrinks by this factor (back toward "as predicted")
MARGIN = 0.25  # a draft must bring this much more than its position costs (its price is measured on a noisy machine)
GAIN_MARGIN = 0.1  # and a step's drafts together must promise this much more than the plain step's tokens/s: how
# a step's time splits between "verifying at all" and "a position" is poorly known where step times wander, so a
# small predicted gain can be a loss end to end
FIXED_POSITIONS = 16.0  # prior of the step's time model: the fixed part of a step costs as much as 16 rows
PRIOR_STRENGTH = 4.0  # the prior per-row slope counts as this much spread of rows (rows²) in the fit
DECAY = 0.98  # weight of a batch size's older steps in its time model at each new step (~50 steps' memory)
PLAIN_EVERY = 32  # at least one decode step in this many goes without drafts (anchors the plain step's time)
DRAFT_PRIOR = 4.0  # the prior price of a drafted position counts as one step with this many drafts
RIDGE_ONCE = 1.0  # pull of the once-per-drafted-step term toward 0 (one drafted step's worth)
OUTLIER = 2.0  # a step counts as at most this many times its predicted time


_CLASS_OF = [max(0, sum(length >= c for c in LENGTH_CLASSES) - 1) for length in range(MAX_MATCH + 1)]


class PromptIndex:
    """A row's n-grams (n = 1..MAX_NGRAM) → where their most recent occurrence that something follows starts."""

    __slots__ = ("tokens", "_grams")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._grams: list[dict] = [{} for _ in range(MAX_NGRAM)]

    def extend(self, tokens) -> None:
        """Append tokens; the n-grams they complete that are now followed by something are indexed."""
        at = len(self.tokens)
        self.tokens += tokens
        seq = self.tokens
        for end in range(max(at - 1, 0), len(seq) - 1):  # n-grams ending at `end`, followed by seq[end + 1]
            for n in range(1, min(MAX_NGRAM, end + 1) + 1):
                self._grams[n - 1][tuple(seq[end - n + 1 : end + 1])] = end - n + 1

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the most recent earlier occurrence of the longest matching suffix, how many
        tokens the match agrees on: its n and as many before them, up to MAX_MATCH); ([], 0) when nothing matches."""
        seq, size = self.tokens, len(self.tokens)
        for n in range(min(MAX_NGRAM, size - 1), 0, -1):
            start = self._grams[n - 1].get(tuple(seq[size - n :]))
            if start is None:
                continue
            length = n
            while (
                length < MAX_MATCH
                and start - (length - n) > 0
                and seq[start - (length - n) - 1] == seq[size - length - 1]
            ):
                length += 1
            return seq[start + n : start + n + k], length
        return [], 0


def lookup(tokens, k: int) -> list[int]:
    """Prompt lookup over a token list at once (what a row's index answers after seeing `tokens`)."""
    index = PromptIndex()
    index.extend([int(t) for t in tokens])
    return index.propose(k)[0]


def length_class(length: int) -> int:
    return _CLASS_OF[min(length, MAX_MATCH)]


class MatchStats:
    """Acceptance by match length class, learnt over every row (greedy rows and sampled rows apart): decayed counts
    of accepted drafts and of first-rejected drafts (drafts after it were never judged), so that accepted /
    (accepted + rejected) is the chance that a draft is accepted when the ones before it were."""

    def __init__(self) -> None:
        self.accepted = [[p * PRIOR_WEIGHT for p in PRIOR_P] for _ in range(2)]  # [sampled][class]
        self.rejected = [[(1 - p) * PRIOR_WEIGHT for p in PRIOR_P] for _ in range(2)]

    def p(self, sampled: bool, length: int) -> float:
        c = length_class(length)
        accepted = self.accepted[sampled][c]
        return accepted / (accepted + self.rejected[sampled][c])

    def observe(self, sampled: bool, length: int, drafted: int, accepted: int) -> None:
        c = length_class(length)
        self.accepted[sampled][c] = CLASS_DECAY * self.accepted[sampled][c] + accepted
        self.rejected[sampled][c] = CLASS_DECAY * self.rejected[sampled][c] + (accepted < drafted)


class RowStats:
    """A row's drafting record and its lookup index (kept on the batcher's Sequence; not sequence state: a
    recompute keeps both, as its tokens stay the same).

    `accepted` and `expected` are decayed counts of the row's accepted drafts and of what the match lengths
    predicted for them; their ratio scales the row's p. `pending` is what its drafts in flight were judged by
    (the shared MatchStats, sampled, match length, the p the class gave), learnt from when their result comes."""

    __slots__ = ("accepted", "expected", "pending", "index")

    def __init__(self) -> None:
        self.accepted = self.expected = 0.0
        self.pending: tuple[MatchStats, bool, int, float] | None = None
        self.index: PromptIndex | None = None  # built on the first lookup

    @property
    def factor(self) -> float:
        """How the row's drafts do against their match lengths' prediction (1: as predicted)."""
        return (self.accepted + ROW_PRIOR) / (self.expected + ROW_PRIOR)

    def observe(self, drafted: int, accepted: int) -> None:
        if not drafted or self.pending is None:
            return
        stats, sampled, length, p = self.pending
        self.pending = None
        stats.observe(sampled, length, drafted, accepted)
        self.accepted = ROW_DECAY * self.accepted + accepted
        self.expected = ROW_DECAY * self.expected + sum(p**j for j in range(1, drafted + 1))

    def idle(self) -> None:
        """A step without drafts: the record fades, back toward "as predicted"."""
        self.accepted *= REVERT
        self.expected *= REVERT

    def lookup(self, s, k: int) -> tuple[list[int], int]:
        """The row's drafts (at most k) and their match length, from its index, brought up to its tokens."""
        if self.index is None:
            self.index = PromptIndex()
            self.index.extend(s.req.input_ids.tolist())
        have = len(self.index.tokens) - s.prompt_len
        if have < len(s.output):
            self.index.extend(s.output[have:])
        return self.index.propose(k)


class StepCost:
    """What a decode-only step's forward takes, learnt from the step results' `forward_s`, per size of the batch
    (rows 1, 2–3, 4–7, 8–15, …: at one row a step is mostly the weights' read and a drafted position is nearly
    free, at 16 it is mostly compute): t ≈ fixed + per_row × R + (once + per_draft × D if D drafts), fitted by
    least squares over that size's steps, older ones weighing DECAY less at each new one. `once` is what verifying
    any draft costs, pulled toward 0 (RIDGE_ONCE).

    - Priors: the fixed part costs FIXED_POSITIONS rows (PRIOR_STRENGTH rows² of evidence), and a drafted position
      what a row does by that split (DRAFT_PRIOR² drafts²), so the model answers before anything varied; in steady
      serving R hardly varies, so the per-row slope stays near its prior, which matters little as the step is
      predicted at the R it was measured at.
    - A drafted position is priced from the same fit as the plain step, so the two cannot drift apart
      (docs/speculative-decoding.md). At least one decode step in PLAIN_EVERY goes without drafts, anchoring the
      fixed part.
    - A step slower than OUTLIER times the prediction (a cold kernel: oneDNN's first call of a shape) counts as
      that much; as the evidence for D fades when a size stops drafting, its price goes back toward the prior and
      drafting is tried again after a few hundred steps."""

    def __init__(self) -> None:
        self._sums: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # size class → (XᵀX, Xᵀt, steps seen)
        self._fits: dict[int, np.ndarray] = {}  # size class → [fixed, per row, once, per draft]
        self.since_plain = 0  # decode-only steps with drafts timed since the last one without

    def observe(self, positions: int, rows: int, drafted: bool, seconds: float) -> None:
        """A decode-only step of `rows` rows and `positions` positions (its drafts: positions − rows) took `seconds`."""
        self.since_plain = self.since_plain + 1 if drafted else 0
        cls = int(rows).bit_length()
        x = np.array([1.0, rows, float(drafted), positions - rows])
        xtx, xty, seen = self._sums.get(cls, (np.zeros((4, 4)), np.zeros(4), 0))
        if seen >= 4:  # one cold step must not carry the fit
            predicted = float(self._fit(cls) @ x)
            seconds = min(seconds, OUTLIER * predicted)
        self._sums[cls] = (DECAY * xtx + np.outer(x, x), DECAY * xty + x * seconds, seen + 1)
        self._fits.pop(cls, None)

    def _fit(self, cls: int) -> np.ndarray:
        if cls not in self._fits:
            xtx, xty, _ = self._sums[cls]
            mean_t, mean_r = xty[0] / xtx[0, 0], xtx[0, 1] / xtx[0, 0]
            row = mean_t / (FIXED_POSITIONS + mean_r)
            prior = np.array([FIXED_POSITIONS * row, row, 0.0, row])
            ridge = np.diag([0.0, PRIOR_STRENGTH, RIDGE_ONCE, DRAFT_PRIOR**2])
            fit = np.linalg.solve(xtx + ridge + 1e-9 * np.eye(4), xty + ridge @ prior)
            fit[2:] = np.maximum(fit[2:], 0.0)  # the fixed part may come out negative: R hardly varies, and the
            # intercept only has to make fixed + per_row × R right near the R measured
            self._fits[cls] = fit
        return self._fits[cls]

    def model(self, rows: int) -> np.ndarray | None:
        """[fixed, per row, once, per draft] in seconds for a batch of `rows` rows, or None before any step of its
        size."""
        cls = int(rows).bit_length()
        return self._fit(cls) if cls in self._sums else None

    def time(self, rows: int) -> float:
        """Predicted seconds of a plain decode step of `rows` rows (relative units before any was timed)."""
        m = self.model(rows)
        return FIXED_POSITIONS + rows if m is None else max(float(m[0] + m[1] * rows), 1e-6)

    def drafting(self, rows: int) -> tuple[float, float]:
        """Predicted seconds that verifying drafts adds to a decode step of `rows` rows (once, per drafted position)."""
        m = self.model(rows)
        return (0.0, 1.0) if m is None else (float(m[2]), float(m[3]))

    def wants_plain(self) -> bool:
        """Whether the next decode-only step should go without drafts: none of the last PLAIN_EVERY did."""
        return self.since_plain >= PLAIN_EVERY


class Drafter:
    def __init__(self, speculate: int, always: bool = False) -> None:
        self.speculate = speculate
        self.always = always  # --speculate-policy always: every proposal that fits is drafted, whatever its price
        self.cost = StepCost()
        self.matches = MatchStats()
        self._planned: dict[int, tuple[int, int, bool]] = {}  # decode-only step → (positions, rows, drafted)
        self.gain = 0.0  # tokens/s with the last step's drafts over without, as the rule predicted (tests, logs)

    def timed(self, step: int, forward_s: float) -> None:
        """A step's result came: a decode-only step's time goes into the model."""
        planned = self._planned.pop(step, None)
        if planned is not None and forward_s > 0:
            self.cost.observe(*planned, forward_s)
        if len(self._planned) > 64:  # steps that never came back (forgotten plans)
            self._planned.clear()

    def _plain(self, sampled: int, rows: int) -> tuple[float, float, float, float, float]:
        """(the plain step's tokens per second, the least a draft must be worth, the plain step's time, what a drafted
        position adds): a draft must bring (1 + MARGIN) times the tokens its position costs at the plain rate."""
        # a step with a prompt chunk is priced as the decode step of its rows (its chunk left out): the chunk would
        # make drafts look cheaper than anything measured says (only decode-only steps are timed)
        t0, (once, per_draft) = self.cost.time(rows), self.cost.drafting(rows)
        plain = sampled / max(t0, 1e-9)
        return plain, (1 + MARGIN) * plain * per_draft, t0, once, per_draft

    def choose(self, worth: list[float], owner: list[int], sampled: int, rows: int) -> dict[int, int]:
        """Row index → how many of its drafts to take: of the drafts worth the margin (`worth`: expected tokens, a
        row's j-th draft never worth more than its (j-1)-th), the best first, as many as maximise the step's
        predicted tokens per second; none when no number of them beats the step without drafts by GAIN_MARGIN."""
        self.gain = 0.0
        plain, least, t0, once, per_draft = self._plain(sampled, rows)
        order = [j for j in np.argsort(worth, kind="stable")[::-1].tolist() if worth[j] >= least]
        if not order or plain <= 0:
            return {}
        tokens = sampled + np.cumsum(np.asarray(worth)[order])
        times = t0 + once + per_draft * np.arange(1, len(order) + 1)
        rates = tokens / times
        best = int(np.argmax(rates))
        self.gain = float(rates[best] / plain)
        if self.gain <= 1.0 + GAIN_MARGIN:
            return {}
        out: dict[int, int] = {}
        for j in order[: best + 1]:
            out[owner[j]] = out.get(owner[j], 0) + 1
        return out

    def could_pay(self, sampled: int, rows: int, most: int) -> bool:
        """Whether sure drafts (MAX_P each) would be taken in this step, one of them or `most`: when not, no row is
        looked up (tokens per second over the drafts taken is monotone in their number, so the two ends tell)."""
        plain, least, t0, once, per_draft = self._plain(sampled, rows)
        if not most or MAX_P < least:
            return False
        rate = [(sampled + k * MAX_P) / (t0 + once + per_draft * k) for k in (1, most)]
        return max(rate) > plain * (1 + GAIN_MARGIN)

    def propose(self, rows: list) -> dict[int, list[int]]:
        """Row index → the drafts worth verifying, for the decode rows of a planned step ((sequence, tokens fed)
        each). The batcher trims them to its token budget and free blocks, then tells `planned` what it kept."""
        base = sum(n for _, n in rows)
        sampled = sum(s.computed + n == s.total for s, n in rows)
        decodes = [i for i, (s, n) in enumerate(rows) if n == 1 and s.computed + 1 == s.total]
        decode_only = sampled == len(rows) and base == len(rows)
        could = self.could_pay(sampled, len(rows), len(decodes) * self.speculate)
        could = self.always or (could and not (decode_only and self.cost.wants_plain()))
        proposed, worth, owner = {}, [], []
        for i in decodes:
            s = rows[i][0]
            room = min(self.speculate, s.req.max_new_tokens - len(s.output) - 1) if could else 0
            drafts, length = self.lookup(s, room) if room > 0 else ([], 0)
            if not drafts:  # no room, or no match
                s.drafting.idle()
                continue
            draws = s.req.sampling.samples()
            p = self.matches.p(draws, length)
            s.drafting.pending = (self.matches, draws, length, p)
            p = min(p * s.drafting.factor, MAX_P)
            proposed[i] = drafts
            worth += [p**j for j in range(1, len(drafts) + 1)]
            owner += [i] * len(drafts)
        wants = (
            {i: len(d) for i, d in proposed.items()} if self.always else self.choose(worth, owner, sampled, len(rows))
        )
        for i, drafts in proposed.items():
            proposed[i] = drafts[: wants.get(i, 0)]
        return proposed

    def planned(self, step: int, rows: list, proposed: dict[int, list[int]], kept: dict[int, list[int]]) -> None:
        """The batcher planned `step` with `kept` of the `proposed` drafts: a row left without any learns nothing
        from this step, and a decode-only step is remembered, to be timed when its result comes."""
        for i in proposed:
            if not kept.get(i):
                s = rows[i][0]
                s.drafting.pending = None
                s.drafting.idle()
        base = sum(n for _, n in rows)
        sampled = sum(s.computed + n == s.total for s, n in rows)
        if sampled == len(rows) and base == len(rows):  # decode-only: its time teaches the model
            self._planned[step] = (base + sum(len(d) for d in kept.values()), len(rows), bool(kept))

    def lookup(self, s, k: int) -> tuple[list[int], int]:
        """The row's drafts (at most k) and the length of the match they came from: prompt lookup."""
        return s.drafting.lookup(s, k)
