"""Liveness from heartbeats: a process counts as gone STALE_AFTER seconds after its last one, or at once when
its last heartbeat says it is leaving (a clean stop); a role lost less than RESTART_WAIT_S ago is awaited."""

import pytest

from libs.protocol.messages import Heartbeat
from libs.runtime.liveness import RESTART_WAIT_S, STALE_AFTER, Liveness


def age(lv: Liveness, seconds: float) -> None:
    lv.since -= seconds
    lv._seen = {k: (t - seconds, hb) for k, (t, hb) in lv._seen.items()}
    lv._left = {k: t - seconds for k, t in lv._left.items()}


def test_leaving_heartbeat_drops_the_process_at_once():
    lv = Liveness()
    lv.record(Heartbeat(role="scheduler", index=0, pid=1))
    lv.record(Heartbeat(role="scheduler", index=1, pid=2, ready=False))
    assert [hb.index for hb in lv.alive("scheduler")] == [0, 1] and lv.ready("scheduler")
    lv.record(Heartbeat(role="scheduler", index=0, pid=1, leaving=True))
    assert [hb.index for hb in lv.alive("scheduler")] == [1] and not lv.ready("scheduler")


def test_a_role_never_heard_is_awaited_for_the_first_wait_of_a_view():
    lv = Liveness()
    assert lv.awaited("detokenizer")  # a live process may not have been heard yet
    assert RESTART_WAIT_S - 0.5 < lv.wait_left("detokenizer") <= RESTART_WAIT_S
    age(lv, RESTART_WAIT_S)
    assert not lv.awaited("detokenizer") and lv.wait_left("detokenizer") == 0.0


def test_a_live_role_is_not_awaited():
    lv = Liveness()
    lv.record(Heartbeat(role="tokenizer", index=0, pid=1))
    assert not lv.awaited("tokenizer") and lv.wait_left("tokenizer") == 0.0


@pytest.mark.parametrize("lost", ["stale", "left"])
def test_a_lost_role_is_awaited_for_the_wait_after_its_loss(lost):
    lv = Liveness()
    age(lv, 60)
    lv.record(Heartbeat(role="tokenizer", index=0, pid=1))
    lv.record(Heartbeat(role="tokenizer", index=1, pid=2))
    if lost == "stale":  # kill -9: its heartbeats stop; lost when the last one goes stale
        age(lv, STALE_AFTER + 0.5)
    else:  # a clean stop of both: lost at once
        lv.record(Heartbeat(role="tokenizer", index=0, pid=1, leaving=True))
        assert lv.alive("tokenizer") and not lv.awaited("tokenizer")  # one of two is enough
        lv.record(Heartbeat(role="tokenizer", index=1, pid=2, leaving=True))
    assert not lv.alive("tokenizer") and lv.awaited("tokenizer")
    assert lv.wait_left("tokenizer") == pytest.approx(RESTART_WAIT_S - (0.5 if lost == "stale" else 0.0), abs=0.2)
    lv.record(Heartbeat(role="tokenizer", index=0, pid=3))  # restarted
    assert not lv.awaited("tokenizer")
    age(lv, STALE_AFTER + RESTART_WAIT_S)  # it too is gone, for longer than the wait: missing, not awaited
    assert not lv.alive("tokenizer") and not lv.awaited("tokenizer")


def test_a_view_that_missed_time_starts_over():
    """A router stopped (SIGSTOP) or starved for longer than a heartbeat lifetime holds only old heartbeats: its
    live detokenizer looks long gone. After resume() it is awaited again, so a request waits for the next beat."""
    lv = Liveness()
    lv.record(Heartbeat(role="detokenizer", index=0, pid=1))
    age(lv, STALE_AFTER + RESTART_WAIT_S + 1.0)  # the process slept through its peers' heartbeats
    assert not lv.alive("detokenizer") and not lv.awaited("detokenizer")  # would fail the request at once
    lv.resume()
    assert lv.awaited("detokenizer")
    lv.record(Heartbeat(role="detokenizer", index=0, pid=1))  # the beats that queued up while it slept
    assert lv.alive("detokenizer") and not lv.awaited("detokenizer")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("libs.runtime.liveness.time.monotonic", c)
    return c


def beat(lv: Liveness, run: str, pid: int, **load) -> bool:
    return lv.record(Heartbeat(role="scheduler", index=0, pid=pid, instance=run, **load))


def test_a_second_run_claiming_a_live_identity_is_refused(clock):
    lv = Liveness()
    assert beat(lv, "first", 1, queue=2)
    clock.now += 0.4
    assert beat(lv, "second", 2, queue=9)  # a newer run: a restart, as far as anyone can tell yet
    assert [(hb.pid, hb.queue) for hb in lv.alive("scheduler")] == [(2, 9)]
    clock.now += 0.6
    assert beat(lv, "first", 1, queue=3)  # but the first beats again: it was alive, the newer one is refused
    assert lv.refused == {("scheduler", 0): {"second"}}
    assert [(hb.pid, hb.queue) for hb in lv.alive("scheduler")] == [(1, 3)]
    for _ in range(5):  # however long it goes on
        clock.now += 1.0
        assert not beat(lv, "second", 2)
        assert beat(lv, "first", 1)
        assert [hb.pid for hb in lv.alive("scheduler")] == [1]
    assert not beat(lv, "second", 2, leaving=True)  # and its goodbye does not drop the first
    assert [hb.pid for hb in lv.alive("scheduler")] == [1]


def test_a_run_restarted_after_a_crash_takes_over_at_once(clock):
    lv = Liveness()
    assert beat(lv, "crashed", 1)
    clock.now += 0.5  # the old run dies without a word; its restart beats, not ready yet
    assert beat(lv, "restarted", 2, ready=False)
    assert [hb.pid for hb in lv.alive("scheduler")] == [2] and not lv.ready("scheduler")
    for _ in range(5):
        clock.now += 1.0
        assert beat(lv, "restarted", 2)
    assert [hb.pid for hb in lv.alive("scheduler")] == [2] and lv.refused == {}
    assert not beat(lv, "crashed", 1, leaving=True)  # another run's goodbye takes nothing
    assert beat(lv, "third", 3) and [hb.pid for hb in lv.alive("scheduler")] == [3]
    assert beat(lv, "third", 3, leaving=True) and lv.alive("scheduler") == []
    assert beat(lv, "fourth", 4)
