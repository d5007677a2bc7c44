"""A real SchedulerService on an ipc bus of its own (no router, no shard), for tests that drive its turns by hand
and read what it publishes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator

import zmq

from libs.protocol import Addresses
from libs.runtime import metrics
from libs.runtime.settings import Settings
from services.scheduler.__main__ import SchedulerService
from tests.services.scheduler.test_batcher import EOS


@contextlib.contextmanager
def scheduler_on_own_bus(*subscribe: str) -> Iterator[tuple[SchedulerService, zmq.Socket]]:
    """(the service, a SUB bound where the router's proxy would take every service's events, subscribed to
    `subscribe`); a tiny llama config with EOS as its only end."""
    with tempfile.TemporaryDirectory(prefix="sy-sched-", dir="/tmp") as run:
        model = f"{run}/model"
        os.mkdir(model)
        with open(f"{model}/config.json", "w") as f:
            json.dump({"model_type": "llama", "eos_token_id": EOS}, f)
        settings = Settings(bus=f"ipc://{run}", model_path=model)
        metrics.init("scheduler", 0, settings)  # as service.run does before the service starts
        events = zmq.Context.instance().socket(zmq.SUB)
        events.bind(Addresses.parse(settings.bus).events_in)
        for topic in subscribe:
            events.subscribe(topic)
        svc = SchedulerService(settings)
        svc.log = logging.getLogger("test.scheduler")
        try:
            yield svc, events
        finally:
            events.close(linger=0)
            for sock in (svc.inbox, svc.plans, svc.results, svc.events.pub, svc.events.sub, svc.shard_watch):
                sock.close(linger=0)
