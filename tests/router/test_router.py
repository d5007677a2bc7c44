"""The router process's placement loop on a real ipc bus: a router that has just restarted holds what it cannot
place yet (it has heard no detokenizer or scheduler), places it on the first heartbeats, and fails it only once
a heartbeat lifetime has passed with nobody heard (the e2e kill -9 of the router found this: new requests got
"No detokenizer is available" for up to a second after its restart while /health said 200)."""

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
from libs.runtime.liveness import STALE_AFTER
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
            for sock in (replica_in, r.admit, *r.replicas):
                sock.close()


def request(i: int) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=f"req-{i}",
        ingress=0,
        input_ids=np.arange(1, 9, dtype=np.int32),
        sampling=SamplingParams(),
        max_new_tokens=4,
    )


def heartbeat(role: str) -> Heartbeat:
    return Heartbeat(role=role, index=0, pid=os.getpid())


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
    r.liveness.since -= STALE_AFTER  # a heartbeat lifetime later: a live detokenizer would have been heard
    r._place_held()
    assert failed == ["No detokenizer is available"] and placed(replica_in) == []
    r.place(request(1))  # from now on at once
    assert failed == ["No detokenizer is available"] * 2
