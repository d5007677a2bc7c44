"""Liveness from heartbeats: a process counts as gone STALE_AFTER seconds after its last one, or at once when
its last heartbeat says it is leaving (a clean stop)."""

from libs.protocol.messages import Heartbeat
from libs.runtime.liveness import STALE_AFTER, Liveness


def test_leaving_heartbeat_drops_the_process_at_once():
    lv = Liveness()
    lv.record(Heartbeat(role="scheduler", index=0, pid=1))
    lv.record(Heartbeat(role="scheduler", index=1, pid=2, ready=False))
    assert [hb.index for hb in lv.alive("scheduler")] == [0, 1] and lv.ready("scheduler")
    lv.record(Heartbeat(role="scheduler", index=0, pid=1, leaving=True))
    assert [hb.index for hb in lv.alive("scheduler")] == [1] and not lv.ready("scheduler")


def test_a_view_settles_one_heartbeat_lifetime_after_it_starts():
    lv = Liveness()
    assert not lv.settled()  # a live process may not have been heard yet
    lv.since -= STALE_AFTER
    assert lv.settled()
