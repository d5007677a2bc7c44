"""Stored responses (`store: true`, the default): what `previous_response_id` continues and GET
/v1/responses/{id} returns.

The store is this http process's memory: bounded (the oldest entry goes first when full) and expiring (an entry
lives `ttl` seconds from its creation). With several http workers (--http-workers), a follow-up request may reach
another worker, which does not know the id: it answers 404, as for an expired id (README).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import msgspec

from services.http.responses_api.schemas import Response

CAPACITY = 1024  # responses kept per http process
TTL_S = 3600.0  # seconds a stored response lives


class Stored(msgspec.Struct):
    response: Response
    conversation: list[dict]  # the chat messages up to and including this response's output (no instructions)
    expires: float


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY, ttl: float = TTL_S, clock=time.monotonic) -> None:
        self.capacity, self.ttl, self.clock = capacity, ttl, clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: Response, conversation: list[dict]) -> None:
        self._expire()
        self.entries[response.id] = Stored(response, conversation, self.clock() + self.ttl)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop the expired entries: they were put in order of expiry, so they sit at the front."""
        now = self.clock()
        while self.entries:
            key, entry = next(iter(self.entries.items()))
            if entry.expires > now:
                break
            del self.entries[key]

    def __len__(self) -> int:
        return len(self.entries)
