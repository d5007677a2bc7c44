"""The one clock of the micro-benchmarks (linear, lora, quant): the median of timed calls, in ms."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, reps: int, warm: bool = False) -> float:
    """Median wall time of `reps` calls of `fn`; `warm` makes one untimed call first (packing, allocation)."""
    if warm:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000
