"""Sibling sequences: the `n` choices of one OpenAI request (one `group`, the same prompt). The first to run
prefills the prompt; each other one forks that sibling's full prompt blocks (one more reference per block, see
block_allocator.py) and computes only the prompt's tail, so the prompt is computed once whatever `n` is. A sibling
waits at the head of the queue while a sibling ahead of it has not yet planned those blocks; the shard runs steps
in order, so blocks planned in an earlier step hold their KV when a later step reads them. With no sibling running
(all done, or preempted) a sibling prefills on its own, and the prefix cache may still serve it."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from services.scheduler.sequence import Sequence


class Siblings:
    def __init__(self, block_size: int, counters: dict[str, int]):
        self.block_size, self.counters = block_size, counters
        counters.setdefault("sibling_shared_tokens", 0)  # prompt tokens a sibling took from another's blocks

    def _shareable(self, s: Sequence) -> int:
        """How many of `s`'s first blocks a sibling's could stand for: full prompt blocks, short of the last token
        (it must be fed: its logits give the next token); 0 when it computes its whole prompt (its prompt
        logprobs are asked and not yet sent)."""
        if not s.req.group or (s.req.sampling.prompt_logprobs and not s.opened):
            return 0
        return min(s.total - 1, s.prompt_len) // self.block_size

    def _of(self, s: Sequence, others: Iterable[Sequence]) -> Iterable[Sequence]:
        for o in others:
            if o is not s and o.req.group == s.req.group and np.array_equal(o.req.input_ids, s.req.input_ids):
                yield o

    def fork(self, s: Sequence, running: Iterable[Sequence], picked: Iterable[Sequence]) -> list[int] | None:
        """The blocks `s` starts from, taken from a running sibling (not held yet: the batcher acquires them);
        [] when it has nothing to take; None when a sibling is still to plan them (`s` waits for it)."""
        full = self._shareable(s)
        if full == 0:
            return []
        pending = any(True for _ in self._of(s, picked))  # admitted in this step: planned only after it
        for o in self._of(s, running):
            if o.computed >= full * self.block_size and len(o.blocks) >= full:
                return o.blocks[:full]
            pending = True
        return None if pending else []

    def count(self, s: Sequence, cached: list[int], running: Iterable[Sequence]) -> None:
        """Once per admitted sequence: the prompt tokens it shares with a running sibling (forked, or found in the
        prefix cache where that sibling registered them)."""
        if not cached or not s.req.group:
            return
        if any(o.blocks[: len(cached)] == cached for o in self._of(s, running)):
            self.counters["sibling_shared_tokens"] += len(cached) * self.block_size
