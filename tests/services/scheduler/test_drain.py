"""A replica's drain as its scheduler runs it (services/scheduler/drain.py): SIGTERM wakes the loop at once and the
next heartbeat says `draining` out of turn; an idle replica stops once the router has had its time to hear it; one
still holding requests at the timeout answers each `Unknown` (http resubmits it elsewhere) before it stops; a second
SIGTERM stops at once. The shards' readiness goes out of turn the same way, both when it comes and when it goes, and
so does the end of the last request a replica held.
The real SchedulerService on an ipc bus of its own, no model, no router."""

from __future__ import annotations

import os
import signal
import time

import pytest

from libs.protocol import codec, topics
from libs.protocol.messages import Heartbeat, Unknown
from libs.protocol.step_messages import StepResult
from services.scheduler.drain import SETTLE_S
from tests.services.scheduler.service_bus import scheduler_on_own_bus
from tests.services.scheduler.test_abort_order import step, subscribed
from tests.services.scheduler.test_batcher import req


@pytest.fixture
def service():
    with scheduler_on_own_bus(topics.out(0), topics.hb("scheduler", 0)) as (svc, events):
        yield svc, events


def received(events, kind, timeout_ms: int = 5000) -> list:
    """Every message of `kind` that arrives until none has come for a while (the first waited for)."""
    got = []
    while events.poll(timeout_ms if not got else 300):
        _, msg = codec.decode_pub(events.recv_multipart())
        if isinstance(msg, kind):
            got.append(msg)
    return got


def test_sigterm_announces_the_drain_at_once_and_hands_back_what_it_holds_at_the_timeout(service):
    svc, events = service
    subscribed(svc, events)
    running, waiting = req("running", 5, 50), req("waiting", 5, 50)
    svc.batcher.add(running)
    step(svc, 1, 40)  # `running` has its first token
    svc.batcher.add(waiting)
    svc._beat()  # the regular beat, not draining
    assert [hb.draining for hb in received(events, Heartbeat)] == [False]

    old = signal.getsignal(signal.SIGTERM)
    try:
        svc.drain.install()
        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        svc._receive(5000)  # the signal's byte wakes the poll: no waiting for a message
        assert time.monotonic() - started < 1.0
        assert svc.drain.active
        svc._beat()  # out of turn: the last beat was just now
        assert [hb.draining for hb in received(events, Heartbeat)] == [True]
        assert svc.drain.outcome(holding=2) is None  # within the timeout: the requests go on
        svc.drain.since -= svc.drain.timeout  # the timeout passed
        assert svc.drain.outcome(holding=2) == "timeout"
        svc._hand_back()
        assert sorted(m.request_id for m in received(events, Unknown)) == ["running", "waiting"]
        with pytest.raises(KeyboardInterrupt):  # a second SIGTERM stops at once (its handler runs as os.kill returns)
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.set_wakeup_fd(-1)


def test_an_idle_replica_stops_once_the_router_had_time_to_hear_its_drain(service):
    svc, _ = service
    assert svc.drain.outcome(holding=0) is None  # not draining
    svc.drain._on_sigterm(signal.SIGTERM, None)
    assert svc.drain.outcome(holding=0) is None  # not announced yet
    svc._beat()
    assert svc.drain.outcome(holding=0) is None  # announced just now: a request placed meanwhile may still come
    svc.drain.announced -= SETTLE_S
    assert svc.drain.outcome(holding=1) is None  # it holds one: it runs to its end
    assert svc.drain.outcome(holding=0) == "drained"


def test_readiness_is_announced_out_of_turn_when_it_changes(service):
    svc, events = service
    subscribed(svc, events)
    svc._beat()  # the regular beat: not ready yet
    assert [hb.ready for hb in received(events, Heartbeat)] == [False]
    svc._beat()  # nothing changed and none is due: silence
    assert received(events, Heartbeat, timeout_ms=300) == []
    svc._on_message(StepResult(step=0))  # the shards answered the probe
    svc._beat()  # the last beat was just now, yet the router hears it at once
    assert [hb.ready for hb in received(events, Heartbeat)] == [True]
    svc._shard_lost()
    svc._beat()
    assert [hb.ready for hb in received(events, Heartbeat)] == [False]


def test_the_end_of_the_last_request_is_announced_out_of_turn(service):
    """The router counts a replica's load from its beats: told at once that the replica is idle, it does not send a
    burst that comes right after to the other replicas only."""
    svc, events = service
    subscribed(svc, events)
    for rid, max_new in (("a", 2), ("b", 3)):
        r = req(rid, 5, max_new)
        r.detokenizer = 0  # the router's choice
        svc.batcher.add(r)
    svc._beat()  # the regular beat: two held
    assert [(hb.queue, hb.running) for hb in received(events, Heartbeat)] == [(2, 0)]
    step(svc, 1, 40)
    step(svc, 2, 41)  # `a` has its two tokens and ends; `b` runs on
    svc._beat()  # one still held, none due: silence
    assert received(events, Heartbeat, timeout_ms=300) == []
    step(svc, 3, 42)  # `b` ends too
    assert not svc.batcher.running and not svc.batcher.waiting
    svc._beat()  # the last beat was just now, yet the router hears at once that nothing is held
    assert [(hb.queue, hb.running) for hb in received(events, Heartbeat)] == [(0, 0)]
    svc._beat()  # said already: silence until the regular beat
    assert received(events, Heartbeat, timeout_ms=300) == []
