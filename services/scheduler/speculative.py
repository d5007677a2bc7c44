"""Drafting for speculative decoding (`--speculate N`): prompt lookup, and the rule that turns it down by itself.

Prompt lookup (no draft model): a row's last n tokens (n = 3, then 2, then 1) are searched for in the row's own
prompt and output; the most recent earlier occurrence proposes the up-to-N tokens that followed it. Input-copying
work (editing code, quoting a document) finds long matches; free writing finds few, and most are wrong.

Verifying a draft costs a position in the step's forward (LM head, attention, MLP), so drafts must pay:
- per row, an exponential moving average of its acceptance (accepted / drafted, per drafted step) decides: a row
  drafts while its average is at least MIN_ACCEPTANCE (it starts at 1: a copy often begins with a few misses, a
  free-writing row falls below within about four drafted steps), and otherwise one probe token every
  PROBE_EVERY steps, and only on a match of two tokens or more, so that a row whose text turns to copying is
  noticed again at little cost;
- per step, the drafts of all rows together are capped by STEP_DRAFT_BUDGET minus the rows (a batch of one may
  verify many drafts for the price of one forward; a large batch, which is already compute-bound, few), the
  rows with the best acceptance first;
- grammar-constrained rows never draft (a seam: drafts are not checked against the grammar's mask yet), and
  every draft fits the row's max_new_tokens (the bonus token included), the step's token budget and the KV
  blocks that are free without preempting anyone (the batcher checks the last two).
The shard's verification (services/shard/speculative.py) keeps outputs exactly what they would be without drafts.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up
MIN_ACCEPTANCE = 0.3  # a row drafts while its acceptance average is at least this
EMA_WEIGHT = 0.3  # weight of the newest drafted step in the average
PROBE_EVERY = 8  # a row below MIN_ACCEPTANCE drafts one token this often (steps), on a match of PROBE_NGRAM
PROBE_NGRAM = 2
STEP_DRAFT_BUDGET = 24  # drafts of one step ≤ this minus its rows (never fewer than 0)
INITIAL_ACCEPTANCE = 1.0  # a new row starts optimistic


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
    """A row's drafting record (kept on the batcher's Sequence; not sequence state: a recompute keeps it)."""

    __slots__ = ("acceptance", "since_draft")

    def __init__(self) -> None:
        self.acceptance = INITIAL_ACCEPTANCE
        self.since_draft = 0  # steps since the row last drafted

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance += EMA_WEIGHT * (accepted / drafted - self.acceptance)


class Drafter:
    def __init__(self, speculate: int) -> None:
        self.speculate = speculate

    def wanted(self, stats: RowStats) -> int:
        """How many drafts a row may propose this step by its own record (before the step's budget)."""
        stats.since_draft += 1
        if stats.acceptance >= MIN_ACCEPTANCE:
            return self.speculate
        return 1 if stats.since_draft >= PROBE_EVERY else 0

    def step_budget(self, rows: int) -> int:
        return max(0, STEP_DRAFT_BUDGET - rows)

    def draft(self, batcher, rows: list) -> dict[int, list[int]]:
        """Row index → drafts, for the decode rows of a planned step that may draft, within the step's leftover
        token budget and the blocks free without preempting anyone (grown here for the drafts)."""
        budget = min(batcher.max_batch_prefill_tokens - sum(n for _, n in rows), self.step_budget(len(rows)))
        wants = []
        for i, (s, n) in enumerate(rows):
            if n == 1 and s.computed + 1 == s.total and not s.req.grammar:  # a decode; grammar rows never draft
                want = min(self.wanted(s.drafting), s.req.max_new_tokens - len(s.output) - 1)
                if want > 0:
                    wants.append((-s.drafting.acceptance, i, want))
        out, bs, allocator = {}, batcher.block_size, batcher.allocator
        for _, i, want in sorted(wants):  # the best record first
            s = rows[i][0]
            held = len(s.blocks) * bs - (s.computed + 1)  # slots its blocks hold past the fed token
            spare = max(0, allocator.free - batcher.watermark) * bs
            drafts = self.propose(s.tokens(0, s.total), min(want, budget, held + spare), s.drafting)
            if not drafts:
                continue
            need = -(-(s.computed + 1 + len(drafts)) // bs) - len(s.blocks)
            if need > 0:
                s.blocks += allocator.allocate(need)
            out[i] = drafts
            budget -= len(drafts)
            batcher.counters["draft_tokens"] += len(drafts)
        return out

    def propose(self, tokens: np.ndarray, k: int, stats: RowStats) -> list[int]:
        """The row's drafts (at most k), from prompt lookup over its tokens."""
        if k <= 0:
            return []
        probe = stats.acceptance < MIN_ACCEPTANCE
        drafts = lookup(tokens, k, min_ngram=PROBE_NGRAM if probe else 1).tolist()
        if drafts:
            stats.since_draft = 0
        return drafts
