"""kill -9 any one process: supervisord restarts it, its peers reconnect, and the server serves
correctly again. (Saving the requests in flight at that moment is the fault-tolerance issue's.)"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests
from transformers import AutoTokenizer

from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

ROLES = ["router", "tokenizer", "detokenizer", "scheduler", "shard", "http"]


def generate(url: str, text: str) -> list[int] | None:
    body = {"inputs": text, "parameters": {"max_new_tokens": 6, "details": True}}
    try:
        r = requests.post(url + "/generate", json=body, timeout=5)
    except requests.RequestException:
        return None
    return [t["id"] for t in r.json()["details"]["tokens"]] if r.status_code == 200 else None


@pytest.mark.parametrize("role", ROLES)
def test_server_recovers_after_kill(tiny_server, tiny_model_dir, role):
    text = f"after the {role} restarts"
    expected = reference_generate(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir)(text).input_ids, 6)
    old = tiny_server.pid(role)
    os.kill(old, signal.SIGKILL)
    deadline, got = time.monotonic() + 90, None
    while time.monotonic() < deadline and got is None:
        time.sleep(0.5)
        got = generate(tiny_server.url, text)
    assert tiny_server.pid(role) not in (0, old), "supervisord did not restart it"
    assert got == expected
    while requests.get(tiny_server.url + "/health", timeout=5).status_code != 200:  # heartbeats catch up
        assert time.monotonic() < deadline
        time.sleep(0.5)
