"""Sibling sequences: the `n` choices of one OpenAI request (one `group`, the same prompt). The first to run
prefills the prompt; each other one forks that sibling's full prompt blocks (one more reference per block, see
block_allocator.py) and computes only the prompt's tail, so the prompt is computed once whatever `n` is. A sibling
waits at the head of the queue while a sibling ahead of it has not yet planned those blocks; the shard runs steps
in order, so blocks planned in an earlier step hold their KV when a later step reads them. With no sibling running
(all done, or preempted) a sibling prefills on its own, and the prefix cache may still serve it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from services.scheduler.sequence import Sequence

MAX_GROUPS = 10_000  # groups remembered (a group's siblings arrive together)


class Siblings:
    def __init__(self, block_size: int, counters: dict[str, int]):
        self.block_size, self.counters = block_size, counters
        counters.setdefault("sibling_shared_tokens", 0)  # prompt tokens a sibling took from another's blocks
        self._admitted: OrderedDict[str, None] = OrderedDict()  # groups whose first sibling was admitted

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

    def fork(
        self, s: Sequence, running: Iterable[Sequence], picked: Iterable[Sequence], cached: int = 0
    ) -> list[int] | None:
        """The blocks `s` starts from, taken from a running sibling (not held yet: the batcher acquires them);
        [] when it has nothing to take or the prefix cache holds them all (`cached` blocks found there); None when a
        sibling is still to plan them (`s` waits for it)."""
        full = self._shareable(s)
        if full == 0 or cached >= full:
            return []
        pending = any(True for _ in self._of(s, picked))  # admitted in this step: planned only after it
        for o in self._of(s, running):
            if o.computed >= full * self.block_size and len(o.blocks) >= full:
                return o.blocks[:full]
            pending = True
        return None if pending else []

    def count(self, s: Sequence, cached: list[int]) -> None:
        """Once per admitted sequence: the prompt tokens a sibling admitted after the first of its group starts
        from (forked from a running sibling, or found in the prefix cache where a sibling that already ended
        registered them, as one whose single token came with its prefill)."""
        if not s.req.group:
            return
        if s.req.group not in self._admitted:
            self._admitted[s.req.group] = None
            while len(self._admitted) > MAX_GROUPS:
                self._admitted.popitem(last=False)
            return
        self.counters["sibling_shared_tokens"] += len(cached) * self.block_size
