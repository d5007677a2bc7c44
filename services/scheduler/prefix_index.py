"""The prefix cache's bookkeeping for the batcher: which cached blocks a new prompt can start from, and which blocks
a step filled, by chain hashes of their tokens over the block allocator's index (block_allocator.py holds the
index, reference counts and LRU reuse). An adapter's blocks are hashed under its own key, so a base-model prefix
never serves an adapter's request (and a reloaded adapter gets a new key: `hash_keys`)."""

from __future__ import annotations

from libs.protocol.prefix_hash import extend_hashes
from services.scheduler.block_allocator import BlockAllocator
from services.scheduler.sequence import Sequence


class PrefixIndex:
    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool, counters: dict[str, int]):
        self.allocator, self.block_size, self.enabled, self.counters = allocator, block_size, enabled, counters
        # adapter name → what seeds its prefix hashes, for adapters loaded at run time (name + load generation):
        # a reloaded adapter of the same name must not hit the blocks of the one before
        self.hash_keys: dict[str, str] = {}

    def lookup(self, s: Sequence) -> list[int]:
        """The cached blocks of the longest prefix of `s` (always leaving at least one token to feed)."""
        if not self.enabled or (s.req.sampling.prompt_logprobs and not s.opened):
            return []
        usable = s.total - 1  # the last token must be fed: its logits give the next token
        if not s.hashes:
            extend_hashes(s.hashes, s.tokens(0, usable), usable, self.block_size, self._key(s), s.req.images)
        return self.allocator.lookup(s.hashes[: usable // self.block_size])

    def count(self, s: Sequence, cached: list[int]) -> None:
        """The prefix counters, once per admitted sequence (a step that admits nothing looks its head up again)."""
        if not s.hashes or s.preempted:  # no lookup was made, or a recompute: not a query of the prompt's prefix
            return
        self.counters["prefix_queried_tokens"] += (s.total - 1) // self.block_size * self.block_size
        self.counters["prefix_hit_tokens"] += len(cached) * self.block_size
        if s.req.adapter:
            self.counters["lora_prefix_hit_tokens"] += len(cached) * self.block_size

    def register(self, rows: list[tuple[Sequence, int, int, int]], running: dict[int, Sequence]) -> None:
        """A step wrote its rows' KV: index every block it filled (a drafted row: its accepted tokens only)."""
        if not self.enabled:
            return
        bs = self.block_size
        for s, handle, _, _ in rows:
            full = s.computed // bs  # its own handle: what the step computed (drafts: as accepted)
            if s.seq != handle or handle not in running or full <= s.registered:
                continue
            if len(s.hashes) < full:
                extend_hashes(s.hashes, s.tokens(0, full * bs), full * bs, bs, self._key(s), s.req.images)
            for i in range(s.registered, full):
                self.allocator.register(s.blocks[i], s.hashes[i])
            s.registered = full

    def _key(self, s: Sequence) -> str | None:
        return self.hash_keys.get(s.req.adapter, s.req.adapter) if s.req.adapter else None
