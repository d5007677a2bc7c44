"""http's restart hold counts only the tokenizers of the request's own model (Ingress._heard), on a real router's
bus over ipc: a default-model request while only another model's tokenizer lives fails at once with 503 "No
tokenizer is available" (intake reaches only the default model's tokenizers: it would wait there for nobody), and
one while the default model's tokenizer is restarting waits for it, though another model's lives."""

from __future__ import annotations

import asyncio
import logging
import tempfile

import numpy as np
import pytest
import zmq

from libs.protocol import Addresses, topics
from libs.protocol.messages import TokenizeResult
from libs.runtime import bus
from libs.runtime.settings import Settings
from services.http.ingress import Ingress
from services.router.__main__ import Router
from tests.services.http.test_ingress_wait import tokenize_request, until

DEFAULT, OTHER = "model-a", "model-b"


@pytest.fixture
def settings():
    """http's settings for the default model A, on a router's bus (its event proxy and intake streamer)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:  # short: ipc paths have a length limit
        settings = Settings(bus=f"ipc://{run_dir}", model_id=DEFAULT)
        r = Router(settings)
        try:
            yield settings
        finally:
            for sock in (r.admit, *r.replicas.values()):
                sock.close()


async def started(settings_) -> tuple[Ingress, bus.EventBus]:
    """An ingress whose view is long up (nothing awaited for having just started), hearing another model's
    tokenizer."""
    addresses = Addresses.parse(settings_.bus)
    ingress = Ingress(settings_.bus, 0, settings_)
    await ingress.start()
    ingress.liveness.since -= 60
    other = bus.EventBus(addresses, "tokenizer", 1, subscribe=[])
    other.start()
    other.heartbeat(model=OTHER)
    await until(lambda: ingress.liveness.alive("tokenizer"))
    return ingress, other


def waits(caplog) -> int:
    return sum("no live tokenizer yet: the request waits" in rec.getMessage() for rec in caplog.records)


def test_a_default_model_request_with_only_another_models_tokenizer_fails_at_once(settings, caplog):
    inbox = bus.socket(zmq.PULL, connect=Addresses.parse(settings.bus).tokenize)  # intake's far end

    async def scenario():
        ingress, other = await started(settings)
        with pytest.raises(Exception, match="No tokenizer is available") as failed:
            await asyncio.wait_for(ingress.tokenize(tokenize_request("r-1")), 10)  # not the admit timeout
        assert failed.value.status == 503
        await ingress.stop()
        other.pub.close()
        other.sub.close()

    try:
        with caplog.at_level(logging.INFO, logger="switchyard.http"):
            asyncio.run(scenario())
        assert waits(caplog) == 0 and not inbox.poll(200)  # neither held nor sent
    finally:
        inbox.close()


def test_a_default_model_request_waits_for_its_restarting_tokenizer_beside_another_models(settings, caplog):
    addresses = Addresses.parse(settings.bus)
    inbox = bus.socket(zmq.PULL, connect=addresses.tokenize)

    async def scenario():
        ingress, other = await started(settings)
        own = bus.EventBus(addresses, "tokenizer", 0, subscribe=[])
        own.start()
        own.heartbeat(model=DEFAULT)
        await until(lambda: len(ingress.liveness.alive("tokenizer")) == 2)
        own.publish(own.hb_topic, own.heartbeat_message(model=DEFAULT, leaving=True))  # it restarts
        await until(lambda: len(ingress.liveness.alive("tokenizer")) == 1)
        waiting = asyncio.create_task(ingress.tokenize(tokenize_request("r-2")))
        await until(lambda: waits(caplog) == 1)
        assert not waiting.done() and not inbox.poll(0)
        own.publish(own.hb_topic, own.heartbeat_message(model=DEFAULT))  # back
        assert await asyncio.to_thread(inbox.poll, 10_000)
        assert bus.recv(inbox).request_id == "r-2"
        ids = np.array([1], dtype=np.int32)
        own.publish(topics.out(0), TokenizeResult(request_id="r-2", text="hello", ids=ids, starts=ids, stops=ids))
        assert (await asyncio.wait_for(waiting, 10)).request_id == "r-2"
        await ingress.stop()
        for eb in (own, other):
            eb.pub.close()
            eb.sub.close()

    try:
        with caplog.at_level(logging.INFO, logger="switchyard.http"):
            asyncio.run(scenario())
        assert any("a tokenizer is back" in rec.getMessage() for rec in caplog.records)
    finally:
        inbox.close()
