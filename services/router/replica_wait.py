"""Requests of a model whose every live replica is draining, held by the router until one is not.

A draining replica takes nothing new, and placing on another model's replica would give the request the wrong
model, so such a request waits: in a rolling restart the replacement joins (its first heartbeat) and takes it,
and no stream is lost. Once the model's replicas are no longer all draining (one joined, or the draining ones
left) the request is placed as any other (held for a restarting scheduler, replica 0's socket, or the 503 of a
named model with none). It waits at most WAIT_S: a little less than http's admit timeout, so the client gets the
reason (`every replica of model … is draining`, 503) rather than http's bare "not admitted in time".
"""

from __future__ import annotations

from collections import OrderedDict

from libs.protocol.messages import TokenizedRequest
from libs.runtime.timeouts import ADMIT_TIMEOUT, STALL_S

WAIT_S = ADMIT_TIMEOUT - STALL_S


class ReplicaWait:
    def __init__(self) -> None:
        # request id → (request, when it began to wait), in arrival order
        self.held: OrderedDict[str, tuple[TokenizedRequest, float]] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.held

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, req: TokenizedRequest, now: float) -> bool:
        """Hold `req` from `now`; False when it already waits (http's watchdog resubmitted it: it keeps its
        place and its start)."""
        if req.request_id in self.held:
            return False
        self.held[req.request_id] = (req, now)
        return True

    def forget(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def release(self, all_draining, now: float) -> tuple[list[TokenizedRequest], list[TokenizedRequest]]:
        """(to place, to fail), in arrival order: those whose model `all_draining(model)` no longer says, and
        those that waited WAIT_S; the rest keep waiting."""
        place, fail = [], []
        for rid, (req, since) in list(self.held.items()):
            if not all_draining(req.model):
                place.append(req)
            elif now - since >= WAIT_S:
                fail.append(req)
            else:
                continue
            del self.held[rid]
        return place, fail
