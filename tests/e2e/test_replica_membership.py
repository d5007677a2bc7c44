"""A replica joins a running server by starting: a second launcher, `serve --only scheduler,shard --replica-base 1`
as on another host, is placed on by the router from its first heartbeat (the router's per-replica counters, read
from its heartbeats through a tap), with nothing in the router's configuration naming it; once it stops, placement
goes back to replica 0 and every request is still answered, greedy-equal to transformers."""

from __future__ import annotations

import pytest

from libs.protocol.messages import Heartbeat
from libs.runtime import bus
from tests.e2e.server import Server, free_port_range
from tests.e2e.test_scale import LIMITS, Tap, check_greedy, prompt

pytestmark = pytest.mark.e2e


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
        tap = Tap(spec, prefixes=(b"hb.",))

        def placed() -> dict[str, int]:
            return tap.counters("router").get(0, {})

        later = Server(
            tiny_model_dir, tmp_path / "later.log", *common, "--only", "scheduler,shard", "--replica-base", "1"
        )

        def replica_1_ready() -> bool:
            return any(isinstance(m, Heartbeat) and m.role == "scheduler" and m.index == 1 and m.ready and m.address
                       for _, m in tap.seen())  # fmt: skip

        tap.wait_for(replica_1_ready, timeout=180)
        check_greedy(first.url, tiny_model_dir, tiny_tokenizer, [(prompt(500 + i), 5) for i in range(6)])
        on_1 = tap.wait_for(lambda: placed().get("placed_replica_1", 0))
        assert later.proc.poll() is None

        later.stop()  # its last heartbeat says it is leaving: the router counts it gone at once
        later = None
        before = placed()
        check_greedy(first.url, tiny_model_dir, tiny_tokenizer, [(prompt(600 + i), 5) for i in range(4)])
        after = tap.wait_for(
            lambda: placed() if placed().get("placed_replica_0", 0) >= before["placed_replica_0"] + 4 else None
        )
        assert after["placed_replica_1"] == on_1, "a request went to the replica that left"
    finally:
        if tap is not None:
            tap.close()
        if later is not None:
            later.stop()
        first.stop()
