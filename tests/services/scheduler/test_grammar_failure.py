"""A row whose grammar failed on the shard (StepResult.errors: no token fits) ends that request alone with a clear
generation error on its ingress topic; the other requests of the batch go on (the real SchedulerService on an ipc
bus of its own; no model, no router: this test binds the event proxy's input itself)."""

from __future__ import annotations

import pytest

from libs.protocol import codec, topics
from libs.protocol.messages import RequestError
from tests.services.scheduler.service_bus import scheduler_on_own_bus
from tests.services.scheduler.test_batcher import result
from tests.services.scheduler.test_grammar_rows import req as unrouted


def req(rid: str, prompt_len: int, max_new: int, grammar: str = ""):
    r = unrouted(rid, prompt_len, max_new, grammar)
    r.detokenizer = 0  # the router's choice
    return r


@pytest.fixture
def service():
    with scheduler_on_own_bus(topics.out(0)) as (svc, events):
        yield svc, events


def wait_subscribed(svc, events) -> None:
    """PUB/SUB joins late: publish probes until one arrives (a condition polled, no sleep)."""
    probe = RequestError(request_id="probe", message="", error_type="probe")
    for _ in range(200):
        svc.events.publish(topics.out(0), probe)
        if events.poll(50):
            events.recv_multipart()
            while events.poll(50):  # probes still in flight
                events.recv_multipart()
            return
    raise AssertionError("the test's event socket never received a probe")


def test_a_failed_grammar_row_ends_its_request_alone(service):
    svc, events = service
    wait_subscribed(svc, events)
    b = svc.batcher
    b.add(req("bad", 5, 10, grammar="G"))
    b.add(req("good", 5, 10, grammar="G"))
    b.add(req("plain", 5, 10))
    plan = b.plan(1)
    bad, good, plain = (int(s) for s in plan.seqs)
    res = result(plan, {bad: 40, good: 41, plain: 42})
    res.errors = {bad: "grammar: token 40 does not fit the grammar"}
    svc._apply(plan, res)

    frames = events.recv_multipart() if events.poll(5000) else None
    assert frames is not None, "no error was published for the failed row"
    topic, err = codec.decode_pub(frames)
    assert topic == topics.out(0) and isinstance(err, RequestError)
    assert err.request_id == "bad" and err.error_type == "generation"
    assert err.message == "Request failed during generation: grammar: token 40 does not fit the grammar"
    assert not events.poll(200)  # nothing for the others
    assert sorted(s.req.request_id for s in b.running.values()) == ["good", "plain"]
    assert {s.req.request_id: s.output for s in b.running.values()} == {"good": [41], "plain": [42]}

    nxt = b.plan(2)  # the next step: the failed handle is dropped on the shard, the others decode on
    assert bad in nxt.finished and sorted(nxt.seqs.tolist()) == sorted([good, plain])
    assert nxt.token_ids.tolist() == [41, 42] or nxt.token_ids.tolist() == [42, 41]
    held = sum(len(s.blocks) for s in b.running.values())
    assert b.allocator.free == b.allocator.num_blocks - held  # the failed request's block is free again


def test_a_failed_grammar_row_keeps_its_error_for_a_resync(service):
    svc, _ = service
    svc.batcher.add(req("bad", 5, 10, grammar="G"))
    plan = svc.batcher.plan(1)
    (bad,) = (int(s) for s in plan.seqs)
    res = result(plan, {bad: 40})
    res.errors = {bad: "grammar: token 40 does not fit the grammar"}
    svc._apply(plan, res)
    assert (
        svc.streams.get("bad").error == "Request failed during generation: grammar: token 40 does not fit the grammar"
    )
    assert svc.streams.get("bad").open is not None  # the error sits with the stream its first row opened
