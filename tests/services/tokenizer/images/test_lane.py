"""The tokenizer's image lane (services/tokenizer/images/lane.py): work runs on its threads at the lane's nice value,
a slow request holds up no other, results wake the loop's poller, and an exception reaches the loop."""

from __future__ import annotations

import os
import select
import threading

import pytest

from services.tokenizer.images.lane import Lane


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
        lambda req: (threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
        nice=base + 7,
    )
    try:
        lane.submit("a")
        [(req, (thread, nice), seconds)] = collect(lane, 1)
        assert req == "a" and thread.startswith("images") and nice == base + 7 and seconds >= 0
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the loop's own thread keeps its priority
        assert lane.pending == 0
    finally:
        lane.close()


def test_a_slow_request_holds_up_no_other():
    release = threading.Event()

    def work(req):
        if req == "slow":
            assert release.wait(10)
        return req.upper()

    lane = Lane(work, nice=0)
    try:
        lane.submit("slow")
        lane.submit("fast")
        [(req, result, _)] = collect(lane, 1)
        assert (req, result) == ("fast", "FAST") and lane.pending == 1
        release.set()
        [(req, result, _)] = collect(lane, 1)
        assert (req, result) == ("slow", "SLOW") and lane.pending == 0
    finally:
        release.set()
        lane.close()


def test_an_exception_in_the_work_is_raised_on_the_loop():
    def work(req):
        raise RuntimeError(f"broken {req}")

    lane = Lane(work, nice=0)
    try:
        lane.submit("x")
        select.select([lane.fd], [], [], 10)
        with pytest.raises(RuntimeError, match="broken x"):
            lane.ready()
        assert lane.pending == 0
    finally:
        lane.close()
