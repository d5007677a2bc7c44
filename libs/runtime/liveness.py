"""Who is alive, from heartbeats: the router's and http's live view of every process (docs/recovery.md).

A role with no live process is either missing or, if it was lost (or this view began) less than
RESTART_WAIT_S ago, awaited: probably restarting, so work that needs it waits for it (`awaited`) instead of
failing at once. That is the one hold of the recovery protocol: http holds requests for a tokenizer, the router
for a detokenizer and a scheduler.

One role and index is one process run (the heartbeat's `instance`). A newer run replaces the one it finds at
once (a restart after a crash looks so: the old one falls silent), but the old run is remembered for a heartbeat
lifetime: if it beats again it was alive, the newer one claims a live identity (a second "scheduler 0" started on
another host), so the old run is put back and the newer one is refused for good (`refused`: its heartbeats are not
taken any more, and the view and the /metrics series are the old run's again after at most one of the newer
one's beats). The newer run itself hears the old one on their shared topic and exits (libs/runtime/bus.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from libs.protocol.messages import Heartbeat
from libs.runtime.timeouts import RESTART_WAIT_S, STALE_AFTER

__all__ = ["RESTART_WAIT_S", "STALE_AFTER", "Liveness", "Which", "serving"]

# which processes of a role count (those of one model, say); None: all of them
Which = Callable[[Heartbeat], bool] | None


def serving(model: str, default: str) -> Which:
    """Which processes serve `model` ("": `default`, the local model): a heartbeat that names no model serves the
    default, and so does every one where no default is known (a process started without --model-id)."""
    if model and model != default:
        return lambda hb: hb.model == model
    if not default:
        return None
    return lambda hb: hb.model in ("", default)


class Liveness:
    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], tuple[float, Heartbeat]] = {}
        self._left: dict[tuple[str, int], float] = {}  # stopped cleanly (a leaving heartbeat) → when
        self._left_as: dict[tuple[str, int], Heartbeat] = {}  # and its last heartbeat before (what it served)
        self._displaced: dict[tuple[str, int], tuple[float, Heartbeat]] = {}  # a run a newer one replaced
        self.refused: dict[tuple[str, int], set[str]] = {}  # runs refused for claiming a live process's identity
        self.since = time.monotonic()

    def record(self, hb: Heartbeat) -> bool:
        """Take a heartbeat into the view; False when it is not taken: a refused claimant's (see the module's doc)."""
        key, now = (hb.role, hb.index), time.monotonic()
        held = self._seen.get(key)
        if hb.instance and hb.instance in self.refused.get(key, ()):
            return False
        displaced = self._displaced.get(key)
        if displaced is not None and now - displaced[0] >= STALE_AFTER:  # the displaced run died: forget it
            del self._displaced[key]
            displaced = None
        if displaced is not None and hb.instance == displaced[1].instance:
            if hb.leaving:
                return False  # it stops after all: the newer run keeps the index
            # the displaced run is alive: the newer one claims a live identity, and is refused for good
            self._displaced.pop(key)
            if held is not None:
                self.refused.setdefault(key, set()).add(held[1].instance)
            self._seen[key] = (now, hb)
            return True
        if held is not None and hb.instance and held[1].instance and hb.instance != held[1].instance:
            if hb.leaving:
                return False  # another run's goodbye takes nothing with it
            if now - held[0] < STALE_AFTER:  # a newer run while the holder counts as alive: a restart, or a claimant
                self._displaced[key] = held
        if hb.leaving:  # it stops cleanly: gone now, not STALE_AFTER from now
            gone = self._seen.pop(key, None)
            if gone is not None:
                self._left[key], self._left_as[key] = now, gone[1]
            return True
        self._left.pop(key, None)
        self._left_as.pop(key, None)
        self._seen[key] = (now, hb)
        return True

    def alive(self, role: str, which: Which = None) -> list[Heartbeat]:
        """Live processes of a role (those `which` picks), by index."""
        now = time.monotonic()
        live = [
            hb
            for (r, _), (t, hb) in self._seen.items()
            if r == role and now - t < STALE_AFTER and (which is None or which(hb))
        ]
        return sorted(live, key=lambda hb: hb.index)

    def ready(self, role: str) -> bool:
        return any(hb.ready for hb in self.alive(role))

    def lost_at(self, role: str, which: Which = None) -> float:
        """When (time.monotonic) the role's last process (of those `which` picks) was lost: went stale or left;
        when this view began if none was ever heard. Meaningful while none is alive."""
        gone = [t + STALE_AFTER for (r, _), (t, hb) in self._seen.items() if r == role and (which is None or which(hb))]
        for key, t in self._left.items():
            hb = self._left_as.get(key)
            if key[0] == role and (which is None or hb is None or which(hb)):
                gone.append(t)
        return max([*gone, self.since])

    def resume(self) -> None:
        """This view missed time (its process was starved or stopped): what it knows is old, so it starts over,
        as at start: a role with no live process is awaited for RESTART_WAIT_S instead of missing at once."""
        self.since = time.monotonic()

    def wait_left(self, role: str, which: Which = None) -> float:
        """Seconds that work needing `role` (one that `which` picks) should still wait for one to be heard (0.0: do
        not wait: one is alive, or it has been missing for RESTART_WAIT_S)."""
        if self.alive(role, which):
            return 0.0
        return max(0.0, self.lost_at(role, which) + RESTART_WAIT_S - time.monotonic())

    def awaited(self, role: str, which: Which = None) -> bool:
        """No process of `role` (of those `which` picks) is alive, but one is probably restarting: hold work that
        needs it."""
        return self.wait_left(role, which) > 0.0
