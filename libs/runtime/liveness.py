"""Who is alive, from heartbeats: the router's and http's live view of every process (docs/recovery.md).

A role with no live process is either missing or, if it was lost (or this view began) less than
RESTART_WAIT_S ago, awaited: probably restarting, so work that needs it waits for it (`awaited`) instead of
failing at once. That is the one hold of the recovery protocol: http holds requests for a tokenizer, the router
for a detokenizer and a scheduler.
"""

from __future__ import annotations

import time

from libs.protocol.messages import Heartbeat
from libs.runtime.timeouts import RESTART_WAIT_S, STALE_AFTER

__all__ = ["RESTART_WAIT_S", "STALE_AFTER", "Liveness"]


class Liveness:
    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], tuple[float, Heartbeat]] = {}
        self._left: dict[tuple[str, int], float] = {}  # stopped cleanly (a leaving heartbeat) → when
        self.since = time.monotonic()

    def record(self, hb: Heartbeat) -> None:
        key = (hb.role, hb.index)
        if hb.leaving:  # it stops cleanly: gone now, not STALE_AFTER from now
            if self._seen.pop(key, None) is not None:
                self._left[key] = time.monotonic()
            return
        self._left.pop(key, None)
        self._seen[key] = (time.monotonic(), hb)

    def alive(self, role: str) -> list[Heartbeat]:
        """Live processes of a role, by index."""
        now = time.monotonic()
        live = [hb for (r, _), (t, hb) in self._seen.items() if r == role and now - t < STALE_AFTER]
        return sorted(live, key=lambda hb: hb.index)

    def ready(self, role: str) -> bool:
        return any(hb.ready for hb in self.alive(role))

    def lost_at(self, role: str) -> float:
        """When (time.monotonic) the role's last process was lost: went stale or left; when this view began if
        none was ever heard. Meaningful while none is alive."""
        gone = [t + STALE_AFTER for (r, _), (t, _) in self._seen.items() if r == role]
        gone += [t for (r, _), t in self._left.items() if r == role]
        return max([*gone, self.since])

    def resume(self) -> None:
        """This view missed time (its process was starved or stopped): what it knows is old, so it starts over,
        as at start: a role with no live process is awaited for RESTART_WAIT_S instead of missing at once."""
        self.since = time.monotonic()

    def wait_left(self, role: str) -> float:
        """Seconds that work needing `role` should still wait for one to be heard (0.0: do not wait: one is
        alive, or it has been missing for RESTART_WAIT_S)."""
        if self.alive(role):
            return 0.0
        return max(0.0, self.lost_at(role) + RESTART_WAIT_S - time.monotonic())

    def awaited(self, role: str) -> bool:
        """No process of `role` is alive, but one is probably restarting: hold work that needs it."""
        return self.wait_left(role) > 0.0
