"""Who is alive, from heartbeats: the router's and http's live view of every process."""

from __future__ import annotations

import time

from libs.protocol.messages import Heartbeat

from libs.runtime.timeouts import STALE_AFTER

__all__ = ["STALE_AFTER", "Liveness"]


class Liveness:
    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], tuple[float, Heartbeat]] = {}
        self.since = time.monotonic()

    def settled(self) -> bool:
        """Whether this view is a heartbeat lifetime old: before that, a live process may not have been heard."""
        return time.monotonic() - self.since >= STALE_AFTER

    def record(self, hb: Heartbeat) -> None:
        if hb.leaving:  # it stops cleanly: gone now, not STALE_AFTER from now
            self._seen.pop((hb.role, hb.index), None)
            return
        self._seen[(hb.role, hb.index)] = (time.monotonic(), hb)

    def alive(self, role: str) -> list[Heartbeat]:
        """Live processes of a role, by index."""
        now = time.monotonic()
        live = [hb for (r, _), (t, hb) in self._seen.items() if r == role and now - t < STALE_AFTER]
        return sorted(live, key=lambda hb: hb.index)

    def ready(self, role: str) -> bool:
        return any(hb.ready for hb in self.alive(role))
