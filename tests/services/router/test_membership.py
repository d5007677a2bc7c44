"""Replicas join the router by announcing themselves: a scheduler's heartbeat carries the address of its intake,
the router connects to it from that first heartbeat and places on it, and stops placing on a replica whose
heartbeats stop or that says it is draining. Real ipc sockets; the router's own loop state is driven through
`Router.heard`, as its event subscriber would."""

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
from services.scheduler.__main__ import reachable


@pytest.fixture
def fleet():
    """A router configured with replica 0 only (the seed), replica 0's intake, and a second replica's intake at
    an address the router's configuration does not name."""
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
        settings = Settings(bus=f"ipc://{run_dir}")
        seed_in = bus.socket(zmq.PULL, bind=Addresses.parse(settings.bus).replica(0, "in"))
        later_address = f"ipc://{run_dir}/elsewhere-in"
        later_in = bus.socket(zmq.PULL, bind=later_address)
        r = Router(settings)
        r._fail = lambda req, message: pytest.fail(message)
        try:
            yield r, seed_in, later_in, later_address
        finally:
            for sock in (seed_in, later_in, r.admit, *r.replicas.values()):
                sock.close()


def beat(role: str, index: int = 0, **kw) -> Heartbeat:
    return Heartbeat(role=role, index=index, pid=os.getpid(), **kw)


def request(i: int) -> TokenizedRequest:
    rng = np.random.default_rng(i)  # distinct prompts: no prefix affinity between them
    return TokenizedRequest(
        request_id=f"req-{i}",
        ingress=0,
        input_ids=rng.integers(1, 1000, 40).astype(np.int32),
        sampling=SamplingParams(),
        max_new_tokens=4,
    )


def drain(sock: zmq.Socket) -> list[str]:
    out = []
    while sock.poll(300):
        out.append(bus.recv(sock).request_id)
    return out


def settle(r: Router, *schedulers: Heartbeat) -> None:
    r.liveness.since -= 60  # long up: nothing is awaited
    r.heard(beat("detokenizer"))
    for hb in schedulers:
        r.heard(hb)


def test_a_replica_is_placed_on_from_its_first_heartbeat(fleet):
    r, seed_in, later_in, later_address = fleet
    assert list(r.replicas) == [0]
    model = r.settings.model_id  # the router's own: the default model's requests go to it
    settle(r, beat("scheduler", 0, queue=3), beat("scheduler", 1, address=later_address, model=model, max_batch=8))
    assert r.replica_address[1] == later_address
    for i in range(4):
        r.place(request(i))
    got = drain(later_in)
    assert got, "the replica that announced itself got nothing"
    assert r.placed[1] == len(got) and r.placed[0] == len(drain(seed_in))


def test_a_draining_or_gone_replica_gets_nothing_new(fleet):
    r, seed_in, later_in, later_address = fleet
    settle(r, beat("scheduler", 0, queue=9), beat("scheduler", 1, address=later_address, draining=True))
    for i in range(3):
        r.place(request(i))
    assert drain(later_in) == [] and len(drain(seed_in)) == 3
    r.heard(beat("scheduler", 1, address=later_address))  # back to serving: idler, so it takes work
    r.place(request(10))
    assert drain(later_in) == ["req-10"]
    # its heartbeats stop: once stale it is gone and placement returns to replica 0
    r.liveness._seen = {
        k: (t - (STALE_AFTER + 1) if k == ("scheduler", 1) else t, hb) for k, (t, hb) in r.liveness._seen.items()
    }
    r.place(request(11))
    assert drain(seed_in) == ["req-11"] and drain(later_in) == []


def test_a_scheduler_without_an_address_is_not_placed_on_unless_seeded(fleet):
    r, seed_in, later_in, _ = fleet
    settle(r, beat("scheduler", 0, queue=9), beat("scheduler", 1))  # an older scheduler: no announcement
    r.place(request(0))
    assert drain(seed_in) == ["req-0"] and 1 not in r.replicas


def test_the_announced_address_of_a_wildcard_bind_is_this_hosts_name():
    assert reachable("tcp://127.0.0.1:5560") == "tcp://127.0.0.1:5560"
    assert reachable("ipc:///run/x/replica-0-in") == "ipc:///run/x/replica-0-in"
    host = reachable("tcp://0.0.0.0:5560")
    assert host.endswith(":5560") and "0.0.0.0" not in host


def test_a_seeded_replica_announcing_another_address_is_reached_there(fleet):
    """The configured seed names where replica 0 was expected; its announcement wins (as on Kubernetes, where the
    router's own configuration names no replica host)."""
    r, seed_in, later_in, later_address = fleet
    settle(r, beat("scheduler", 0, address=later_address))
    assert r.replica_address[0] == later_address and list(r.replicas) == [0]
    r.place(request(0))
    assert drain(later_in) == ["req-0"] and drain(seed_in) == []
