"""The one clock of the micro-benchmarks (linear, lora, quant, roofline): the median, or the best, of timed calls,
in ms."""

from __future__ import annotations

import statistics
import time


def _times(fn, reps: int, warm: bool) -> list[float]:
    if warm:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_ms(fn, reps: int, warm: bool = False) -> float:
    """Median wall time of `reps` calls of `fn`; `warm` makes one untimed call first (packing, allocation)."""
    return statistics.median(_times(fn, reps, warm)) * 1000


def best_ms(fn, reps: int, warm: bool = True) -> float:
    """Shortest wall time of `reps` calls of `fn` (what the machine can do, for a peak)."""
    return min(_times(fn, reps, warm)) * 1000
