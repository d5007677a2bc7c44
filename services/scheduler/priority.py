"""--scheduling-policy priority: the order in which sequences wait, run and give way (docs/scheduling.md).

A sequence's rank is `priority + arrival / aging_s` (seconds since the scheduler started), then its arrival order:
lower runs first. Every sequence ages at the same rate, so two sequences keep their order for good (no re-sorting
churn, no preemption ping-pong), and equal priorities stay first come, first served. Starvation is bounded by age:
a request waits behind a later one only while their priority gap exceeds their arrival gap in units of `aging_s`,
so one of priority p arriving at t goes ahead of everything of priority q arriving after t + (p - q) * aging_s.
aging_s = 0 turns aging off (strict priority).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable

from services.scheduler.sequence import Sequence


class PriorityOrder:
    def __init__(self, aging_s: float, clock: Callable[[], float] = time.monotonic):
        self.aging_s, self.clock = aging_s, clock
        self.start = clock()
        self._arrivals = itertools.count()

    def stamp(self, s: Sequence) -> None:
        """Give an arriving sequence its rank."""
        aged = (self.clock() - self.start) / self.aging_s if self.aging_s > 0 else 0.0
        s.rank = (s.req.sampling.priority + aged, next(self._arrivals))

    def key(self, s: Sequence) -> tuple[float, int]:
        if not s.rank:  # a sequence made without `add` (stamped on first sight)
            self.stamp(s)
        return s.rank

    def sort(self, waiting: deque[Sequence]) -> None:
        """Best first, in place (nearly sorted already: a preempted sequence went back to the head)."""
        ordered = sorted(waiting, key=self.key)
        waiting.clear()
        waiting.extend(ordered)

    def worst(self, running: Iterable[Sequence]) -> Sequence:
        return max(running, key=self.key)

    def outranks(self, a: Sequence, b: Sequence) -> bool:
        return self.key(a) < self.key(b)
