"""Several models behind one router: a request is placed only on a replica and a detokenizer of its own model (the
default model's, the router's own, when it names none), and a named model that has no replica or detokenizer fails
at once. Real ipc sockets, as tests/services/router/test_membership.py; the router's view is driven through
`Router.heard`."""

from __future__ import annotations

import tempfile

import pytest
import zmq

from libs.protocol import Addresses
from libs.runtime import bus
from libs.runtime.settings import Settings
from services.router.__main__ import Router
from tests.services.router.conftest import DEFAULT, OTHER
from tests.services.router.test_membership import beat, drain, request


def placed_on(sock: zmq.Socket) -> list[tuple[str, int]]:
    out = []
    while sock.poll(300):
        req = bus.recv(sock)
        out.append((req.request_id, req.detokenizer))
    return out


def named(i: int, model: str):
    req = request(i)
    req.model = model
    return req


def test_each_request_goes_to_a_replica_and_a_detokenizer_of_its_model(two_models):
    r, a_in, b_in, failed = two_models
    for i in range(4):  # the default model's: the idle replica of model B is no candidate
        r.place(request(i))
    for i in range(4, 8):
        r.place(named(i, OTHER))
    r.place(named(8, DEFAULT))  # naming the default model is the default
    assert placed_on(a_in) == [(f"req-{i}", 0) for i in (0, 1, 2, 3, 8)]
    assert placed_on(b_in) == [(f"req-{i}", 1) for i in range(4, 8)]
    assert failed == [] and r.placed == {0: 5, 1: 4}


def test_a_named_model_without_a_replica_or_a_detokenizer_fails_at_once(two_models):
    r, a_in, b_in, failed = two_models
    r.place(named(0, "model-c"))
    assert failed == ["No replica of model `model-c` is available"]
    r.heard(beat("detokenizer", 1, model=OTHER, leaving=True))  # B's only detokenizer stops
    r.place(named(1, OTHER))
    assert failed[1:] == [f"No detokenizer of model `{OTHER}` is available"]
    assert drain(a_in) == [] and drain(b_in) == []


def test_a_router_that_names_no_model_places_the_default_on_every_replica():
    """Started without a model of its own (as before models were announced): nothing is filtered out."""
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
        settings = Settings(bus=f"ipc://{run_dir}", model_id="")
        replica_in = bus.socket(zmq.PULL, bind=Addresses.parse(settings.bus).replica(0, "in"))
        r = Router(settings)
        r._fail = lambda req, message: pytest.fail(message)
        try:
            r.liveness.since -= 60
            r.heard(beat("detokenizer", 0, model=OTHER))
            r.heard(beat("scheduler", 0, model=OTHER))
            r.place(request(0))
            assert placed_on(replica_in) == [("req-0", 0)]
        finally:
            for sock in (replica_in, r.admit, *r.replicas.values()):
                sock.close()
