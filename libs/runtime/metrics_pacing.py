"""When a heartbeat carries a fresh render of its process's metrics (libs/runtime/bus.py's `_beat`).

Rendering the metrics text costs the process's own thread, which may be the loop that keeps the model busy, so
renders are spaced to keep that cost near RENDER_SHARE of the time. The spacing is computed from the CPU time the
render took on its thread (`time.thread_time()`), not from wall-clock time: a render preempted on a loaded host
costs nothing while it waits, and counting the wait would space the next render by a thousand times it. And the
spacing is capped at MAX_GAP_S, because a gateway picks replicas from the scheduler's gauges in these renders
(vllm:num_requests_waiting, …): a render that did cost much still leaves them at most MAX_GAP_S old (plus a
heartbeat), at the price of a larger share of time for it.
"""

from __future__ import annotations

RENDER_SHARE = 0.001  # rendering may take this share of its thread's time
MIN_GAP_S = 1.0  # at most one render a second
MAX_GAP_S = 2.0  # and at least one every two seconds, however costly
# a render is due this much before its gap ends, so that with heartbeats MIN_GAP_S apart each one carries one
SLACK_S = 0.05


def gap_after(render_cpu_s: float) -> float:
    """Seconds from a render to the next one, given the CPU seconds the render took on its thread."""
    return min(MAX_GAP_S, max(MIN_GAP_S, render_cpu_s / RENDER_SHARE)) - SLACK_S


class MetricsPacing:
    """Whether a heartbeat sent at a given time carries a fresh render, and when the next one is due."""

    def __init__(self) -> None:
        self.next_due = 0.0  # time.monotonic() from which the next render is due

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def rendered(self, at: float, render_cpu_s: float) -> None:
        """Record a render that started at `at` (time.monotonic()) and took `render_cpu_s` of its thread's CPU."""
        self.next_due = at + gap_after(render_cpu_s)
