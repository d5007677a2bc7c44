"""The one clock of the benchmarks: what every timing reads, and the statistics they report.

`wall` is the wall clock (monotonic seconds); `cpu` the process's CPU seconds (every thread: torch's, a worker's),
steadier than wall time on a busy machine; `thread_cpu` the calling thread's alone. `Lap` reads both around a
stretch of code; `median_ms` / `best_ms` time a callable over repetitions; `p50_ms` is the median of seconds, in ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

wall = time.perf_counter
cpu = time.process_time
thread_cpu = time.thread_time


class Lap:
    """Wall and CPU seconds of one stretch of code: `with Lap() as lap: ...`, then `lap.wall`, `lap.cpu`."""

    __slots__ = ("wall", "cpu", "_wall", "_cpu")

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> Lap:
        self._wall, self._cpu = wall(), cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = wall() - self._wall, cpu() - self._cpu


def times(fn: Callable[[], object], reps: int, warm: bool = False, clock: Callable[[], float] = wall) -> list[float]:
    """Seconds of each of `reps` calls of `fn` by `clock`; `warm` makes one untimed call first."""
    if warm:
        fn()
    out = []
    for _ in range(reps):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def p50_ms(seconds: Iterable[float]) -> float:
    """The median of `seconds`, in ms (0 for none)."""
    values = list(seconds)
    return statistics.median(values) * 1000 if values else 0.0


def median_ms(fn: Callable[[], object], reps: int, warm: bool = False, clock: Callable[[], float] = wall) -> float:
    """Median time of `reps` calls of `fn`; `warm` makes one untimed call first (packing, allocation)."""
    return p50_ms(times(fn, reps, warm, clock))


def best_ms(fn: Callable[[], object], reps: int, warm: bool = True, clock: Callable[[], float] = wall) -> float:
    """Shortest time of `reps` calls of `fn` (what the machine can do, for a peak)."""
    return min(times(fn, reps, warm, clock)) * 1000
