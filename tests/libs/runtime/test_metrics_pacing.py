"""How often a heartbeat carries a fresh metrics render (libs/runtime/metrics_pacing.py): from the render's CPU
time on its thread, never less than a second apart nor more than two, so a gateway reading the scheduler's gauges
never reads values older than that; and the bus's heartbeat measures a render by its thread's CPU time, so a
render preempted on a loaded host does not hold the next one back."""

from __future__ import annotations

import tempfile

import pytest

from libs.protocol import Addresses
from libs.runtime import bus, metrics
from libs.runtime.metrics_pacing import MAX_GAP_S, MIN_GAP_S, RENDER_SHARE, MetricsPacing, gap_after
from libs.runtime.timeouts import HEARTBEAT_S


def test_a_cheap_render_goes_in_every_heartbeat():
    pacing = MetricsPacing()
    assert pacing.due(0.0)
    pacing.rendered(100.0, 0.0004)
    assert not pacing.due(100.5)
    assert pacing.due(100.0 + HEARTBEAT_S)  # the next beat carries one again
    assert gap_after(0.0) == gap_after(0.0004) < HEARTBEAT_S <= MIN_GAP_S


def test_a_costlier_render_is_spaced_to_keep_its_share_of_time():
    gap = gap_after(0.0015)  # 1.5 ms of CPU: the share asks for 1.5 s
    assert gap == pytest.approx(0.0015 / RENDER_SHARE, abs=0.06) and MIN_GAP_S < gap < MAX_GAP_S


@pytest.mark.parametrize("cpu_s", [0.03, 0.5, 30.0])
def test_even_a_very_costly_render_leaves_the_next_at_most_two_seconds_later(cpu_s):
    pacing = MetricsPacing()
    pacing.rendered(100.0, cpu_s)
    assert gap_after(cpu_s) <= MAX_GAP_S == 2.0
    assert not pacing.due(100.0 + HEARTBEAT_S)
    assert pacing.due(100.0 + 2 * HEARTBEAT_S)  # the second beat after it carries one


@pytest.fixture
def ends():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:  # nothing listens: _beat only builds the message
        e = bus.BusEnds(Addresses.parse(f"ipc://{run_dir}"), "scheduler", 0, subscribe=[])
        try:
            yield e
        finally:
            e.pub.close(linger=0)
            e.sub.close(linger=0)


def test_a_render_preempted_for_a_long_wall_clock_time_does_not_delay_the_next(ends, monkeypatch):
    """The render takes 30 s of wall-clock time (the clock jumps while it runs, as when its thread is preempted)
    and little CPU: the next heartbeat that is due still carries a render."""
    clock = [1000.0]
    monkeypatch.setattr(bus.time, "monotonic", lambda: clock[0])
    renders = []

    def exposition():
        renders.append(clock[0])
        clock[0] += 30.0  # preempted
        return "up 1\n"

    monkeypatch.setattr(metrics, "heartbeat_exposition", exposition)
    assert ends._beat({}).metrics == "up 1\n"
    clock[0] += HEARTBEAT_S  # the next beat is due
    assert ends._beat({}).metrics == "up 1\n"
    assert renders == [1000.0, 1031.0]


def test_the_heartbeat_measures_the_render_on_its_threads_cpu_clock(ends, monkeypatch):
    """A render whose thread spent 1.5 ms of CPU is spaced by the share (the next beat carries none, the one after
    does); the thread clock is the one read around the render."""
    clock, cpu = [1000.0], [5.0]
    monkeypatch.setattr(bus.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(bus.time, "thread_time", lambda: cpu[0])

    def exposition():
        cpu[0] += 0.0015
        return "up 1\n"

    monkeypatch.setattr(metrics, "heartbeat_exposition", exposition)
    assert ends._beat({}).metrics == "up 1\n"
    clock[0] += HEARTBEAT_S
    assert ends._beat({}).metrics == ""  # unchanged since the last one, to the aggregator
    clock[0] += HEARTBEAT_S
    assert ends._beat({}).metrics == "up 1\n"
