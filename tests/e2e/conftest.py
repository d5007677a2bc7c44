"""Real servers for the end-to-end tests: one on a tiny test model, one on the embedded Gemma."""

from __future__ import annotations

import pytest

from tests.e2e.server import Server
from tests.tiny_models import build_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tiny-server.log"
    # small limits so the length checks are cheap to reach
    server = Server(tiny_model_dir, log, "--max-total-tokens", "512", "--max-input-tokens", "400")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
