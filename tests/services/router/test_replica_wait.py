"""A request whose model's every live replica is draining waits in the router (services/router/replica_wait.py)
until one is not: a replacement that joins takes it, as in a rolling restart; it never falls back to another
replica (another model's, or the draining one), a resubmission of it waits once, and after WAIT_S it fails with a
503 that says why. Real ipc sockets; the router's view is driven through `Router.heard`, its loop's turn through
`_place_waiting`."""

from __future__ import annotations

import logging

import zmq

from libs.runtime import bus
from services.router.replica_wait import WAIT_S
from tests.services.router.conftest import DEFAULT, OTHER
from tests.services.router.test_membership import beat, drain, request
from tests.services.router.test_models import named


def test_every_replica_draining_holds_the_request_until_a_replacement_joins(two_models, tmp_path, caplog):
    r, a_in, b_in, failed = two_models
    r.heard(beat("scheduler", 0, model=DEFAULT, draining=True))
    with caplog.at_level(logging.INFO, logger="switchyard.router"):
        r.place(request(0))
        r.place(request(0))  # http's watchdog resubmits it meanwhile: it waits once
        r._place_waiting()  # a turn of the loop: still nothing to place it on
    assert "every replica of its model is draining: the request waits" in caplog.text
    assert "req-0" in r.replica_wait and len(r.replica_wait) == 1
    assert drain(a_in) == [] and drain(b_in) == [] and failed == []

    # the replacement announces itself (a new replica index, at its own address)
    address = f"ipc://{tmp_path}/replacement-in"
    replacement_in = bus.socket(zmq.PULL, bind=address)
    try:
        r.heard(beat("scheduler", 2, address=address, model=DEFAULT))
        r._place_waiting()
        assert drain(replacement_in) == ["req-0"] and drain(a_in) == []
        assert len(r.replica_wait) == 0 and r.placed[2] == 1 and failed == []
        r.place(request(0))  # a late resubmission: sticky, where it went
        assert drain(replacement_in) == ["req-0"]
    finally:
        replacement_in.close()


def test_another_models_draining_replica_does_not_send_its_request_to_replica_0(two_models):
    """Model B's only replica (1) drains while model A's replica 0 is idle: B's request waits, and goes to B's
    replica once it takes new requests again (a StatefulSet's replacement pod keeps its index)."""
    r, a_in, b_in, failed = two_models
    r.heard(beat("scheduler", 1, address=r.replica_address[1], model=OTHER, draining=True))
    r.place(named(0, OTHER))
    r.place(request(1))  # the default model's is placed as ever
    assert drain(a_in) == ["req-1"] and drain(b_in) == [] and "req-0" in r.replica_wait
    r.heard(beat("scheduler", 1, address=r.replica_address[1], model=OTHER))
    r.place(request(2))  # the loop's next placement places the waiting one first
    assert drain(b_in) == ["req-0"] and drain(a_in) == ["req-2"] and failed == []


def test_a_request_waits_at_most_wait_s_then_gets_a_503_saying_why(two_models):
    r, a_in, b_in, failed = two_models
    r.heard(beat("scheduler", 1, address=r.replica_address[1], model=OTHER, draining=True))
    r.place(named(0, OTHER))
    req, since = r.replica_wait.held["req-0"]
    r.replica_wait.held["req-0"] = (req, since - WAIT_S + 1)  # a second short of its limit
    r._place_waiting()
    assert failed == [] and "req-0" in r.replica_wait
    r.replica_wait.held["req-0"] = (req, since - WAIT_S)
    r._place_waiting()
    assert failed == [f"No replica of model `{OTHER}` is available: every one is draining"]
    assert len(r.replica_wait) == 0 and drain(a_in) == [] and drain(b_in) == []


def test_once_the_draining_replicas_left_the_request_is_placed_as_any_other(two_models):
    """The drained replica stops: its model has no replica now, so the request goes where a default-model request
    goes with none (replica 0's socket, where it waits for that replica to come back), as if it came now."""
    r, a_in, b_in, failed = two_models
    r.heard(beat("scheduler", 0, model=DEFAULT, draining=True))
    r.place(request(0))
    assert drain(a_in) == []
    r.heard(beat("scheduler", 0, model=DEFAULT, leaving=True))
    r._place_waiting()
    assert len(r.replica_wait) == 0 and drain(a_in) == ["req-0"] and drain(b_in) == [] and failed == []
