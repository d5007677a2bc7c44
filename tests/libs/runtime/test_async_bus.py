"""The asyncio twin of the event bus (libs.runtime.async_bus, http's) on a real router's event proxy over ipc:
its Hello comes back before start() returns, it hears what a synchronous EventBus publishes and the other way
round, its heartbeat carries the load it is given and this process's metrics, and a malformed event is dropped."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

from libs.protocol import Addresses, topics
from libs.protocol.messages import Abort, Heartbeat
from libs.runtime import bus, metrics
from libs.runtime.async_bus import AsyncEventBus
from libs.runtime.settings import Settings
from services.router.__main__ import Router


@pytest.fixture
def addresses():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:  # short: ipc paths have a length limit
        settings = Settings(bus=f"ipc://{run_dir}")
        r = Router(settings)  # binds the bus and runs the event proxy
        try:
            yield Addresses.parse(settings.bus)
        finally:
            for sock in (r.admit, *r.replicas.values()):
                sock.close()


async def next_event(eb: AsyncEventBus, kind: type):
    while True:
        got = await asyncio.wait_for(eb.recv(), 10)
        if got is not None and isinstance(got[1], kind):
            return got


def test_start_heartbeat_and_both_ways_with_a_synchronous_bus(addresses, monkeypatch):
    monkeypatch.setattr(metrics, "heartbeat_exposition", lambda: "up 1\n")
    peer = bus.EventBus(addresses, "tokenizer", 0, subscribe=[topics.out(0)])
    peer.start()

    async def scenario():
        eb = AsyncEventBus(addresses, "http", 0, subscribe=[topics.out(0), topics.HB])
        await eb.start(timeout=10)  # returns only once its own Hello came back
        peer.heartbeat(counters={"handled": 3})
        topic, hb = await next_event(eb, Heartbeat)
        assert topic == topics.hb("tokenizer", 0) and hb.counters == {"handled": 3}
        await eb.publish(topics.out(0), Abort(request_id="r-1"))
        got = None
        while got is None or isinstance(got[1], Heartbeat):  # its own heartbeat comes back too
            assert peer.sub.poll(5000)
            got = peer.recv()
        assert got == (topics.out(0), Abort(request_id="r-1"))
        assert eb.heartbeat_in() == 0.0
        await eb.heartbeat(running=2)  # due: published, with metrics
        assert eb.heartbeat_in() > 0.5
        await eb.heartbeat(running=5)  # not due yet: nothing
        while True:
            topic, hb = await next_event(eb, Heartbeat)
            if topic == eb.hb_topic:
                break
        assert (hb.role, hb.index, hb.running) == ("http", 0, 2)
        assert hb.metrics == "up 1\n"  # this process's exposition text
        eb.pub.send_multipart([topics.out(0), b"not a message"])  # malformed: dropped, logged, None
        assert await asyncio.wait_for(eb.recv(), 10) is None
        eb.pub.close()
        eb.sub.close()

    asyncio.run(scenario())
    peer.pub.close()
    peer.sub.close()


def test_start_without_a_router_times_out():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
        addresses = Addresses.parse(f"ipc://{run_dir}")

        async def scenario():
            eb = AsyncEventBus(addresses, "http", 0, subscribe=[])
            try:
                with pytest.raises(TimeoutError):
                    await eb.start(timeout=0.5)
            finally:
                eb.pub.close()
                eb.sub.close()

        asyncio.run(scenario())
