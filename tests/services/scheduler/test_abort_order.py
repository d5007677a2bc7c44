"""An abort that comes while the last step's rows wait to be published: its end row goes out behind them (the rows
of a step are published one turn later, while the shards compute the next step), so a detokenizer never sees the
end row past a gap. The real SchedulerService on an ipc bus of its own (as test_grammar_failure.py), its published
batches fed to a real Detokenizer; no model, no router."""

from __future__ import annotations

import pytest

from libs.protocol import codec, topics
from libs.protocol.messages import FINISH_ABORTED, Abort, Accepted, RequestError, Resync, TokenBatch
from services.detokenizer.__main__ import Detokenizer
from tests.services.detokenizer.test_incremental import build_tokenizer
from tests.services.scheduler.service_bus import scheduler_on_own_bus
from tests.services.scheduler.test_batcher import req, result


@pytest.fixture
def service():
    """A SchedulerService on an ipc bus of its own, and a SUB bound where the router's proxy would take its events
    (its token batches and the ingress topic)."""
    with scheduler_on_own_bus(topics.out(0), topics.tok(0)) as (svc, events):
        yield svc, events


def step(svc, n: int, token: int) -> None:
    """One turn as SchedulerService.turn runs it, the shard's answer given: plan, publish the previous step's
    rows, apply this step's result (its rows wait for the next turn)."""
    plan = svc.batcher.plan(n)
    svc._publish_unpublished()
    svc.unpublished = svc._apply(plan, result(plan, {int(s): token for s in plan.seqs}))


def published(svc, events, marker: str) -> list[TokenBatch]:
    """The token batches published since the last marker, in order: read up to a marker published after them
    (one PUB socket keeps its order)."""
    svc.events.publish(topics.out(0), RequestError(request_id=marker, message="", error_type="marker"))
    batches = []
    while events.poll(5000):
        _, msg = codec.decode_pub(events.recv_multipart())
        if isinstance(msg, RequestError) and msg.request_id == marker:
            return batches
        if isinstance(msg, TokenBatch):
            batches.append(msg)
    raise AssertionError("the marker never came back")


def subscribed(svc, events) -> None:
    """PUB/SUB joins late: publish markers until one arrives (a condition polled, no sleep)."""
    for n in range(200):
        svc.events.publish(topics.out(0), RequestError(request_id=f"probe{n}", message="", error_type="marker"))
        if events.poll(50):
            published(svc, events, "joined")  # the probes still in flight
            return
    raise AssertionError("the test's event socket never received a probe")


def test_an_abort_between_two_turns_ends_the_stream_in_order(service):
    svc, events = service
    subscribed(svc, events)
    a = req("a", 5, 50)
    a.detokenizer = 0  # the router's choice
    svc.batcher.add(a)
    for n, token in enumerate((40, 41, 42), start=1):
        step(svc, n, token)
    assert [r.offset for r in svc.unpublished] == [2]  # the last step's row waits for the next turn
    svc.pending_ctl.append(Abort(request_id="a"))  # the client went away: the next turn receives the abort
    svc._control()
    assert svc.batcher.plan(4) is None  # nothing left to run
    svc._publish_unpublished()

    batches = published(svc, events, "end")
    sent = [(int(o), int(f)) for b in batches for o, f in zip(b.offsets, b.finish)]
    assert sent == [(0, 0), (1, 0), (2, 0), (3, FINISH_ABORTED)]  # the end after every row, not before the last
    detok = Detokenizer(build_tokenizer())
    rows = [row for b in batches for rs in detok.handle(b)[0].values() for row in rs]
    assert detok.wanted == [] and detok.streams == {}  # no gap seen, and the stream is closed
    assert [r.index for r in rows] == [1, 2, 3, 3] and rows[-1].final.finish_reason == "aborted"
    replay = svc.streams.replay(0, "a")  # what a resync (http's watchdog, a restarted detokenizer) gets
    assert replay.offsets.tolist() == [0, 1, 2, 3] and replay.token_ids.tolist() == [40, 41, 42, -1]


def answered(svc, events, resync: Resync) -> list:
    """What the scheduler publishes in answer to `resync` (read up to a marker published after it)."""
    svc._resync(resync)
    svc.events.publish(topics.out(0), RequestError(request_id="answered", message="", error_type="marker"))
    got = []
    while events.poll(5000):
        _, msg = codec.decode_pub(events.recv_multipart())
        if isinstance(msg, RequestError) and msg.request_id == "answered":
            return got
        got.append(msg)
    raise AssertionError("the marker never came back")


def test_a_slow_stream_is_kept_alive_and_a_lossy_one_replayed(service):
    """http resyncs a stream silent for STALL_S. On a busy machine a live stream is often just slow (a step of
    64 rows can take longer than that): when http has every row published so far, a replay would only repeat them
    (and, every STALL_S, load the detokenizer and http with the whole stream again: the replay storm of a heavy
    load), so the answer is Accepted again; when it misses rows, or a detokenizer asks, the stream is replayed."""
    svc, events = service
    subscribed(svc, events)
    a = req("a", 5, 50)
    a.detokenizer = 0
    svc.batcher.add(a)
    for n, token in enumerate((40, 41, 42), start=1):
        step(svc, n, token)
    svc._publish_unpublished()  # offsets 0, 1, 2 published
    assert len(published(svc, events, "rows")) == 3

    (keepalive,) = answered(svc, events, Resync(request_id="a", ingress=0, delivered=3))  # it has them all
    assert isinstance(keepalive, Accepted) and keepalive.request_id == "a"
    (replay,) = answered(svc, events, Resync(request_id="a", ingress=0, delivered=2))  # offset 2 never came
    assert isinstance(replay, TokenBatch) and replay.reset == ["a"] and replay.offsets.tolist() == [0, 1, 2]
    svc._replayed.clear()  # as if REPLAY_EVERY went by
    (replay,) = answered(svc, events, Resync(request_id="a", ingress=-1))  # a detokenizer asks: it lost rows
    assert isinstance(replay, TokenBatch) and replay.reset == ["a"]
