"""A replica joins a running server by starting: a second launcher, `serve --only scheduler,shard --replica-base 1`
as on another host, is placed on by the router from its first heartbeat (each placement's Accepted on the bus,
and the router's per-replica counters in a heartbeat it sent after those placements, read through a tap), with
nothing in the router's configuration naming it; once it stops, placement goes back to replica 0 and every request
is still answered, greedy-equal to transformers."""

from __future__ import annotations

import pytest

from libs.protocol.messages import Accepted, Heartbeat
from libs.runtime import bus
from tests.e2e.server import Server
from tests.e2e.test_scale import LIMITS, Tap, check_greedy, prompt
from tests.ports import free_port_range

pytestmark = pytest.mark.e2e


def accepted_ids(events, count: int, besides: frozenset = frozenset()) -> frozenset | None:
    """The ids of the first `count` requests placed (an Accepted on the bus) that are not `besides`, once the tap
    has seen that many."""
    ids = []
    for _, msg in events:
        if isinstance(msg, Accepted) and msg.request_id not in besides and msg.request_id not in ids:
            ids.append(msg.request_id)
    return frozenset(ids[:count]) if len(ids) >= count else None


def accepted_of(events, ids: frozenset) -> list[Accepted]:
    return [msg for _, msg in events if isinstance(msg, Accepted) and msg.request_id in ids]


def _router_beat(msg) -> bool:
    return isinstance(msg, Heartbeat) and msg.role == "router"


def router_counters_after(events, ids: frozenset) -> dict[str, int] | None:
    """The counters of the first router heartbeat on the bus after its placements of `ids` (the router publishes
    each Accepted and its heartbeats on one socket, so the tap sees them in the order they were sent): they count
    every one of those placements."""
    last = max(i for i, (_, msg) in enumerate(events) if isinstance(msg, Accepted) and msg.request_id in ids)
    return next((msg.counters for _, msg in events[last + 1 :] if _router_beat(msg)), None)


def router_counters_before(events, ids: frozenset) -> dict[str, int]:
    """The counters of the last router heartbeat before the first placement of any of `ids`."""
    first = min(i for i, (_, msg) in enumerate(events) if isinstance(msg, Accepted) and msg.request_id in ids)
    return [msg.counters for _, msg in events[:first] if _router_beat(msg)][-1]


def test_a_replica_started_later_is_used_and_its_leaving_moves_placement_back(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr(bus, "_curve", None)  # the tap's sockets: plaintext on loopback, as the servers'
    monkeypatch.setattr(bus, "_plaintext_ok", True)
    spec = f"tcp://127.0.0.1:{free_port_range(5)}?replicas=127.0.0.1:{free_port_range(6)}"  # room for replica 1
    common = (*LIMITS, "--bus-address", spec, "--bus-insecure")
    first = Server(tiny_model_dir, tmp_path / "first.log", *common)  # every program, one replica
    later = tap = None
    try:
        first.wait_healthy()
        tap = Tap(spec, prefixes=(b"hb.", b"out."))  # heartbeats and placements (Accepted)

        later = Server(
            tiny_model_dir, tmp_path / "later.log", *common, "--only", "scheduler,shard", "--replica-base", "1"
        )

        def replica_1_ready() -> bool:
            return any(isinstance(m, Heartbeat) and m.role == "scheduler" and m.index == 1 and m.ready and m.address
                       for _, m in tap.seen())  # fmt: skip

        tap.wait_for(replica_1_ready, timeout=180)
        check_greedy(first.url, tiny_model_dir, tiny_tokenizer, [(prompt(500 + i), 5) for i in range(6)])
        first_ids = tap.wait_for(lambda: accepted_ids(tap.seen(), 6))
        assert any(msg.replica == 1 for msg in accepted_of(tap.seen(), first_ids)), "replica 1 was never placed on"
        assert tap.wait_for(lambda: router_counters_after(tap.seen(), first_ids)).get("placed_replica_1", 0) > 0
        assert later.proc.poll() is None

        later.stop()  # its last heartbeat says it is leaving: the router counts it gone at once
        later = None
        check_greedy(first.url, tiny_model_dir, tiny_tokenizer, [(prompt(600 + i), 5) for i in range(4)])
        second_ids = tap.wait_for(lambda: accepted_ids(tap.seen(), 4, besides=first_ids))
        after = tap.wait_for(lambda: router_counters_after(tap.seen(), second_ids))
        events = tap.seen()
        assert {msg.replica for msg in accepted_of(events, second_ids)} == {0}, (
            "a request went to the replica that left"
        )
        # the router's counters agree: from its last heartbeat before the second batch's first placement to one
        # after every placement of it, only replica 0's count moved
        before = router_counters_before(events, second_ids)
        assert after["placed_replica_1"] == before["placed_replica_1"], "a request went to the replica that left"
        assert after["placed_replica_0"] >= before["placed_replica_0"] + 4
    finally:
        if tap is not None:
            tap.close()
        if later is not None:
            later.stop()
        first.stop()
