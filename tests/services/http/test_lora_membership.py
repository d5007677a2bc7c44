"""vLLM's LoRA load route and the aborts of unplaced requests follow the live membership (the schedulers heard by
their heartbeats), not the configured replica count: a replica that joined after start gets the load, one that
leaves while the load runs is not waited for, and one that joins after the load is sent it (catch-up). On a real
router's bus over ipc, with stand-in schedulers that beat and answer as LoraControl does."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from libs.protocol import Addresses, codec, topics
from libs.protocol.lora import AdapterDone, AdapterSet, KnownAdapters, LoadAdapter
from libs.runtime import bus
from libs.runtime.settings import Settings
from services.http import lora, models
from services.http.__main__ import build_app
from services.http.ingress import Ingress
from services.router.__main__ import Router


class Replica(threading.Thread):
    """A scheduler's bus side: it beats, announces its adapters, and (if `answers`) loads what it is sent."""

    def __init__(self, settings: Settings, index: int, answers: bool = True):
        super().__init__(daemon=True)
        self.index, self.answers = index, answers
        self.events = bus.EventBus(Addresses.parse(settings.bus), "scheduler", index, subscribe=[topics.ctl(index)])
        self.events.start()
        self.loads: list[LoadAdapter] = []
        self.names: list[str] = []
        self.running = True
        self.start()

    def run(self) -> None:
        while self.running:
            if self.events.heartbeat_due():
                self.events.heartbeat(ready=True)
                self.events.publish(topics.lora(self.index), AdapterSet(replica=self.index, names=self.names))
            if not self.events.sub.poll(50):
                continue
            got = self.events.recv()
            if got and isinstance(got[1], LoadAdapter):
                msg = got[1]
                self.loads.append(msg)
                if self.answers:
                    self.names.append(msg.name)
                    self.events.publish(topics.lora(self.index), AdapterSet(replica=self.index, names=self.names))
                    done = AdapterDone(op_id=msg.op_id, replica=self.index)
                    self.events.publish(topics.out(msg.ingress), done)

    def leave(self) -> None:
        """Stop as a clean exit does: a last heartbeat saying it is leaving."""
        self.running = False
        self.join(5)
        goodbye = self.events.heartbeat_message(leaving=True)
        self.events.pub.send_multipart(codec.encode_pub(self.events.hb_topic, goodbye))
        time.sleep(0.1)  # the I/O thread sends it before the sockets close
        self.close()

    def close(self) -> None:
        self.running = False
        self.join(5)
        self.events.pub.close()
        self.events.sub.close()


@pytest.fixture
def settings():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:  # short: ipc paths have a length limit
        settings = Settings(bus=f"ipc://{run_dir}", replicas=1)
        r = Router(settings)  # the event proxy
        try:
            yield settings
        finally:
            for sock in (r.admit, *r.replicas.values()):
                sock.close()


async def until(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)
    return got


def test_a_load_follows_the_live_replicas_and_catches_up_a_later_one(settings, monkeypatch):
    # this process's views, restored after: the adapters heard, the loads made, the fleet the ingress attaches to
    for name, fresh in (("KNOWN", KnownAdapters()), ("LOADED", {}), ("_caught", {}), ("_catching", {})):
        monkeypatch.setattr(lora, name, fresh)
    monkeypatch.setattr(models.FLEET, "liveness", models.FLEET.liveness)
    monkeypatch.setattr(models.FLEET, "default", models.FLEET.default)
    replicas: list[Replica] = []

    async def scenario():
        ingress = Ingress(settings.bus, 0, settings)
        await ingress.start()
        # replica 0 (configured), 2 (joined: beyond the configured count), 1 (never answers, then leaves)
        replicas.extend([Replica(settings, 0), Replica(settings, 2), Replica(settings, 1, answers=False)])
        await until(lambda: lora.members(ingress, settings.model_id) == [0, 1, 2])
        async with TestClient(TestServer(build_app(settings, ingress))) as client:
            body = {"lora_name": "extra", "lora_path": "/adapters/extra"}
            load = asyncio.ensure_future(client.post("/v1/load_lora_adapter", json=body))
            silent = replicas[2]
            await until(lambda: silent.loads)  # it was asked too, and holds the answer back
            assert not load.done()
            silent.leave()
            started = time.monotonic()
            r = await asyncio.wait_for(load, 10)
            assert r.status == 200, await r.text()
            assert time.monotonic() - started < 2  # let go once it left, not after the operation's timeout
            assert [len(replicas[i].loads) for i in range(3)] == [1, 1, 1]
            assert {rep.index for rep in replicas[:2] if rep.names == ["extra"]} == {0, 2}
            assert await until(lambda: "extra" in lora.names(settings))

            # an abort of a request not yet placed goes to the live replicas, the joined one included
            assert ingress.live_replicas() == [0, 2]

            # a replica that joins after the load announces a set without it: it is sent the load
            later = Replica(settings, 3)
            replicas.append(later)
            await until(lambda: later.loads, timeout=5)
            assert later.loads[0].name == "extra" and later.loads[0].path == "/adapters/extra"
            assert await until(lambda: "extra" in lora.names(settings))  # every replica holds it again
            assert ingress.live_replicas() == [0, 2, 3]
        await ingress.stop()

    try:
        asyncio.run(scenario())
    finally:
        for rep in replicas:
            rep.close()
