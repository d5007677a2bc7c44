"""The tokenizer's image lane (services/tokenizer/images/lane.py): work runs on its threads at the lane's nice value,
a slow request holds up no other, results wake the loop's poller, and an exception reaches the loop."""

from __future__ import annotations

import os
import select
import threading
from types import SimpleNamespace

import pytest

from services.tokenizer.images.lane import Lane


def req(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id)


def collect(lane: Lane, want: int) -> list:
    """Poll the lane's fd as the service loop does until `want` results are in (10 s at most)."""
    got = []
    while len(got) < want:
        readable, _, _ = select.select([lane.fd], [], [], 10)
        assert readable, f"the lane woke no poller ({len(got)} of {want} results)"
        got += lane.ready()
    return got


def test_work_runs_on_threads_at_the_lanes_nice_value():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lane = Lane(
        lambda r: (threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
        nice=base + 7,
    )
    try:
        lane.submit(req("a"))
        [(done, (thread, nice), seconds)] = collect(lane, 1)
        assert done.request_id == "a" and thread.startswith("images") and nice == base + 7 and seconds >= 0
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the loop's own thread keeps its priority
        assert lane.pending == 0
    finally:
        lane.close()


def test_a_slow_request_holds_up_no_other():
    release = threading.Event()

    def work(r):
        if r.request_id == "slow":
            assert release.wait(10)
        return r.request_id.upper()

    lane = Lane(work, nice=0)
    try:
        lane.submit(req("slow"))
        lane.submit(req("fast"))
        [(done, result, _)] = collect(lane, 1)
        assert (done.request_id, result) == ("fast", "FAST") and lane.pending == 1
        # what the heartbeats name, so that http's watchdog does not resubmit it
        assert lane.holds() == ["slow"] and lane.held("slow") and not lane.held("fast")
        release.set()
        [(done, result, _)] = collect(lane, 1)
        assert (done.request_id, result) == ("slow", "SLOW") and lane.pending == 0 and lane.holds() == []
    finally:
        release.set()
        lane.close()


def test_an_exception_in_the_work_is_raised_on_the_loop():
    def work(r):
        raise RuntimeError(f"broken {r.request_id}")

    lane = Lane(work, nice=0)
    try:
        lane.submit(req("x"))
        select.select([lane.fd], [], [], 10)
        with pytest.raises(RuntimeError, match="broken x"):
            lane.ready()
        assert lane.pending == 0
    finally:
        lane.close()
