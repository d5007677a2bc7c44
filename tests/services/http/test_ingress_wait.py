"""http's side of the restart hold (docs/recovery.md), on a real router's bus over ipc: a request that comes
while the tokenizer is awaited (Liveness.awaited: lost less than RESTART_WAIT_S ago, or never heard yet) waits
for one and goes on when it is heard; when the wait runs out it fails with 503 "No tokenizer is available", as
it did at once before the hold."""

from __future__ import annotations

import asyncio
import logging
import tempfile

import numpy as np
import pytest
import zmq

from libs.protocol import Addresses, topics
from libs.protocol.messages import GenerateRequest, TokenizeResult
from libs.protocol.params import Parameters
from libs.runtime import bus
from libs.runtime.liveness import RESTART_WAIT_S
from libs.runtime.settings import Settings
from services.http.ingress import Ingress
from services.router.__main__ import Router


@pytest.fixture
def settings():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:  # short: ipc paths have a length limit
        settings = Settings(bus=f"ipc://{run_dir}")
        r = Router(settings)  # the event proxy and the intake streamer
        try:
            yield settings
        finally:
            for sock in (r.admit, *r.replicas.values()):
                sock.close()


def tokenize_request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, ingress=0, inputs="hello", parameters=Parameters(), mode="tokenize")


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


def test_a_request_waits_for_a_restarting_tokenizer(settings, caplog):
    addresses = Addresses.parse(settings.bus)
    inbox = bus.socket(zmq.PULL, connect=addresses.tokenize)  # where a tokenizer takes requests

    async def scenario():
        ingress = Ingress(settings.bus, 0, settings)
        await ingress.start()
        waiting = asyncio.create_task(ingress.tokenize(tokenize_request("r-1")))
        await until(lambda: any("waits for one" in rec.getMessage() for rec in caplog.records))
        assert not waiting.done() and not inbox.poll(0)  # held in http: not sent, not failed
        tokenizer = bus.EventBus(addresses, "tokenizer", 0, subscribe=[])
        tokenizer.start()
        tokenizer.heartbeat()  # the restarted tokenizer announces itself
        assert await asyncio.to_thread(inbox.poll, 10_000)
        req = bus.recv(inbox)
        assert req.request_id == "r-1"
        ids = np.array([1, 2], dtype=np.int32)
        result = TokenizeResult(request_id="r-1", text="hello", ids=ids, starts=ids, stops=ids)
        tokenizer.publish(topics.out(0), result)
        got = await asyncio.wait_for(waiting, 10)
        assert got.request_id == "r-1"
        await ingress.stop()

    with caplog.at_level(logging.INFO, logger="switchyard.http"):
        asyncio.run(scenario())
    assert any("a tokenizer is back" in rec.getMessage() for rec in caplog.records)
    inbox.close()


def test_the_wait_runs_out_with_the_503_of_no_tokenizer(settings, caplog):
    async def scenario():
        ingress = Ingress(settings.bus, 0, settings)
        await ingress.start()
        ingress.liveness.since -= RESTART_WAIT_S - 0.3  # the view is almost a wait old
        with pytest.raises(Exception, match="No tokenizer is available") as failed:
            await ingress.tokenize(tokenize_request("r-2"))
        assert failed.value.status == 503
        assert waits() == 1  # it did wait (the log line of a wait that ran out), no clock read: CI is noisy
        ingress.liveness.since -= 1.0
        with pytest.raises(Exception, match="No tokenizer is available"):
            await ingress.tokenize(tokenize_request("r-3"))  # missing for longer: at once, as before
        assert waits() == 1  # no second wait
        await ingress.stop()

    def waits() -> int:
        return sum("no tokenizer came" in rec.getMessage() for rec in caplog.records)

    with caplog.at_level(logging.INFO, logger="switchyard.http"):
        asyncio.run(scenario())
    assert any("no tokenizer came" in rec.getMessage() for rec in caplog.records)
