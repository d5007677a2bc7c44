"""Where a request runs: a model replica (least loaded, with prefix affinity) and a detokenizer shard.

Load comes from the schedulers' heartbeats (queue + running), plus what this router placed since a replica's
last heartbeat, so a burst between two heartbeats does not all land on the replica that looked idlest.

Prefix affinity: a prompt's full KV blocks are hashed as a chain (libs/protocol/prefix_hash.py), the same unit a
replica's prefix cache reuses. The router remembers which replica last took each chain hash; a new
request goes to the replica holding its longest known prefix unless that replica is busier than the least loaded
one by more than `slack` requests — then load wins and the prefix is recomputed elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import numpy as np

from libs.protocol.messages import Heartbeat
from libs.protocol.prefix_hash import prefix_hashes
from libs.runtime.settings import BLOCK_SIZE

MAX_REMEMBERED = 100_000  # chain hashes kept (LRU); ~100 bytes each


class Placement:
    def __init__(self, slack: int = 4):
        self.slack = slack
        self.owner: OrderedDict[bytes, int] = OrderedDict()  # chain hash → replica that last computed it
        self._since_hb: defaultdict[int, int] = defaultdict(int)  # placed on r since r's last heartbeat
        self._next_detok = 0
        self.groups: OrderedDict[str, int] = OrderedDict()  # sibling group (`n` choices) → its replica

    def observe(self, hb: Heartbeat) -> None:
        """A scheduler heartbeat: its own load supersedes what we placed before it."""
        if hb.role == "scheduler":
            self._since_hb[hb.index] = 0

    def choose_replica(
        self,
        input_ids: np.ndarray,
        schedulers: list[Heartbeat],
        adapter: str | None = None,
        group: str = "",
        images=(),
    ) -> int:
        """The replica for a prompt, among the ready schedulers that are not draining (the replicas that joined:
        the caller passes those it can reach); the siblings of a `group` all go where the first
        went while it is alive (their scheduler shares the prompt's KV blocks among them).

        With none ready (shards loading or restarting) any live one that is not draining will do, and with none
        replica 0: the request then waits in that scheduler's queue (or its socket) instead of failing. (A request
        whose model's every live replica is draining never comes here: the router holds it, replica_wait.py.)
        """
        known = [hb for hb in schedulers if not hb.draining]
        candidates = [hb for hb in known if hb.ready] or known
        load = {hb.index: hb.queue + hb.running + self._since_hb[hb.index] for hb in candidates}
        if not load:
            self._since_hb[0] += 1
            return 0
        least = min(load, key=lambda r: (load[r], r))
        if group and self.groups.get(group) in load:
            self._since_hb[self.groups[group]] += 1
            return self.groups[group]
        # a LoRA adapter's KV is its own; an image's placeholder blocks are keyed by the image (prefix_hash.py)
        hashes = prefix_hashes(input_ids, BLOCK_SIZE, adapter, images)
        chosen = least
        for h in reversed(hashes):  # the longest prefix some live replica holds
            r = self.owner.get(h)
            if r in load:
                if load[r] <= load[least] + self.slack:
                    chosen = r
                break
        for h in hashes:
            self.owner[h] = chosen
            self.owner.move_to_end(h)
        while len(self.owner) > MAX_REMEMBERED:
            self.owner.popitem(last=False)
        if group:
            self.groups[group] = chosen
            while len(self.groups) > MAX_REMEMBERED:
                self.groups.popitem(last=False)
        self._since_hb[chosen] += 1
        return chosen

    def choose_detokenizer(self, detokenizers: list[Heartbeat]) -> int | None:
        """Round robin over the live detokenizers: a request's whole stream then stays on that one."""
        if not detokenizers:
            return None
        hb = detokenizers[self._next_detok % len(detokenizers)]
        self._next_detok += 1
        return hb.index
