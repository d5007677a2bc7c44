"""The router tests' shared fixture: a router of model A with a replica and a detokenizer of each of two models
(`Router.heard` drives its view, as its event subscriber would)."""

from __future__ import annotations

import tempfile

import pytest
import zmq

from libs.protocol import Addresses
from libs.runtime import bus
from libs.runtime.settings import Settings
from services.router.__main__ import Router
from tests.services.router.test_membership import beat

DEFAULT, OTHER = "model-a", "model-b"


@pytest.fixture
def two_models():
    """A router of model A; replica 0 serves A, replica 1 (announced at its own address) serves B; a detokenizer
    of each model."""
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
        settings = Settings(bus=f"ipc://{run_dir}", model_id=DEFAULT)
        a_in = bus.socket(zmq.PULL, bind=Addresses.parse(settings.bus).replica(0, "in"))
        b_address = f"ipc://{run_dir}/model-b-in"
        b_in = bus.socket(zmq.PULL, bind=b_address)
        r = Router(settings)
        failed: list[str] = []
        r._fail = lambda req, message: failed.append(message)
        r.liveness.since -= 60  # long up: nothing is awaited
        r.heard(beat("detokenizer", 0, model=DEFAULT))
        r.heard(beat("detokenizer", 1, model=OTHER))
        r.heard(beat("scheduler", 0, model=DEFAULT))
        r.heard(beat("scheduler", 1, address=b_address, model=OTHER))
        try:
            yield r, a_in, b_in, failed
        finally:
            for sock in (a_in, b_in, r.admit, *r.replicas.values()):
                sock.close()
