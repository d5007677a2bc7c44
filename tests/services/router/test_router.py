"""The router process's placement loop on a real ipc bus: while a role a request needs is awaited (restarting:
lost less than RESTART_WAIT_S ago, or never heard by a router that has just started; docs/recovery.md), the
router holds the request, places what it held in arrival order once one is heard, and fails it ("No detokenizer
is available") only once the wait has run out. A kill -9 of the router found the young-router case (new
requests got that 503 for up to a second after its restart while /health said 200), one of the detokenizer
the other (a request sent while the restarted detokenizer had not announced itself yet)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import zmq

from libs.protocol import Addresses
from libs.protocol.messages import Heartbeat, TokenizedRequest
from libs.protocol.params import SamplingParams
from libs.runtime import bus
from libs.runtime.liveness import RESTART_WAIT_S, STALE_AFTER, Liveness
from libs.runtime.settings import Settings
from services.router.__main__ import Router


@pytest.fixture
def router():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:  # short: ipc paths have a length limit
        settings = Settings(bus=f"ipc://{run_dir}")
        replica_in = bus.socket(zmq.PULL, bind=Addresses.parse(settings.bus).replica(0, "in"))
        r = Router(settings)
        failed: list[str] = []
        r._fail = lambda req, message: failed.append(message)
        try:
            yield r, replica_in, failed
        finally:
            for sock in (replica_in, r.admit, *r.replicas.values()):
                sock.close()


def request(i: int) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=f"req-{i}",
        ingress=0,
        input_ids=np.arange(1, 9, dtype=np.int32),
        sampling=SamplingParams(),
        max_new_tokens=4,
    )


def heartbeat(role: str, leaving: bool = False) -> Heartbeat:
    return Heartbeat(role=role, index=0, pid=os.getpid(), leaving=leaving)


def age(lv: Liveness, seconds: float) -> None:
    """Make everything `lv` has seen `seconds` older, as if that much time had passed."""
    lv.since -= seconds
    lv._seen = {k: (t - seconds, hb) for k, (t, hb) in lv._seen.items()}
    lv._left = {k: t - seconds for k, t in lv._left.items()}


def settled_router(r: Router) -> None:
    """A router up for long, which hears a detokenizer and a scheduler."""
    age(r.liveness, 60)
    r.liveness.record(heartbeat("scheduler"))
    r.liveness.record(heartbeat("detokenizer"))


def placed(replica_in: zmq.Socket) -> list[str]:
    out = []
    while replica_in.poll(200):
        out.append(bus.recv(replica_in).request_id)
    return out


def test_a_young_router_holds_requests_until_it_hears_a_detokenizer_and_a_scheduler(router):
    r, replica_in, failed = router
    r.place(request(0))
    r.liveness.record(heartbeat("scheduler"))
    r._place_held()
    r.place(request(1))
    assert placed(replica_in) == [] and failed == []  # no detokenizer heard yet: held, not failed
    r.liveness.record(heartbeat("detokenizer"))
    r._place_held()
    assert placed(replica_in) == ["req-0", "req-1"] and failed == []  # in arrival order
    r.place(request(2))
    assert placed(replica_in) == ["req-2"]


def test_after_a_heartbeat_lifetime_with_no_detokenizer_a_held_request_fails(router):
    r, replica_in, failed = router
    r.liveness.record(heartbeat("scheduler"))
    r.place(request(0))
    assert failed == []
    age(r.liveness, RESTART_WAIT_S)  # a live detokenizer would have been heard by now
    r.liveness.record(heartbeat("scheduler"))
    r._place_held()
    assert failed == ["No detokenizer is available"] and placed(replica_in) == []
    r.place(request(1))  # from now on at once
    assert failed == ["No detokenizer is available"] * 2


@pytest.mark.parametrize("lost", ["killed", "stopped"])
def test_a_request_waits_for_a_restarting_detokenizer(router, caplog, lost):
    """The only detokenizer is lost (kill -9: its heartbeats go stale; a clean stop: it says it leaves) and
    restarts: a request that comes before the new one announces itself waits for it instead of failing."""
    r, replica_in, failed = router
    settled_router(r)
    if lost == "killed":
        age(r.liveness, STALE_AFTER)
        r.liveness.record(heartbeat("scheduler"))  # the scheduler still beats
    else:
        r.liveness.record(heartbeat("detokenizer", leaving=True))
    assert not r.liveness.alive("detokenizer")
    with caplog.at_level("INFO", logger="switchyard.router"):
        r.place(request(0))
        r.place(request(0))  # http resubmits it: it waits once
        r.place(request(1))
        r._place_held()
        assert placed(replica_in) == [] and failed == []
        assert [rec.request_id for rec in caplog.records if "waits for one" in rec.getMessage()] == ["req-0", "req-1"]
        r.liveness.record(heartbeat("detokenizer"))  # the restarted one announces itself
        r._place_held()
    assert placed(replica_in) == ["req-0", "req-1"] and failed == []
    assert any("placing 2 held requests" in rec.getMessage() for rec in caplog.records)


def test_a_request_fails_once_the_detokenizer_has_been_gone_for_the_whole_wait(router):
    r, replica_in, failed = router
    settled_router(r)
    r.liveness.record(heartbeat("detokenizer", leaving=True))
    r.place(request(0))
    assert failed == [] and list(r.held) == ["req-0"]
    age(r.liveness, RESTART_WAIT_S)
    r.liveness.record(heartbeat("scheduler"))
    r._place_held()
    assert failed == ["No detokenizer is available"] and not r.held
    r.place(request(1))  # a lasting outage: at once, as ever
    assert failed == ["No detokenizer is available"] * 2 and placed(replica_in) == []


def test_a_request_waits_for_a_restarting_scheduler_then_goes_where_it_would_have(router):
    """With no scheduler alive a request waits for one; when the wait runs out it is placed all the same (on
    replica 0, where it waits in the socket for the scheduler, as before)."""
    r, replica_in, failed = router
    settled_router(r)
    r.liveness.record(heartbeat("scheduler", leaving=True))
    r.place(request(0))
    assert placed(replica_in) == [] and list(r.held) == ["req-0"]
    r.liveness.record(heartbeat("scheduler"))
    r.place(request(1))  # the held one goes first
    assert placed(replica_in) == ["req-0", "req-1"]
    r.liveness.record(heartbeat("scheduler", leaving=True))
    r.place(request(2))
    age(r.liveness, RESTART_WAIT_S)
    r.liveness.record(heartbeat("detokenizer"))
    r._place_held()
    assert placed(replica_in) == ["req-2"] and failed == []
