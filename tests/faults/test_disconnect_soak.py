"""1,000 clients that leave at random moments (right after sending, mid-body, mid-stream, while waiting for a
non-streamed answer, mid chat stream), 32 at a time: afterwards nothing runs or waits in the scheduler, every KV
block is free, and the server answers a normal request exactly as before."""

from __future__ import annotations

import asyncio

import pytest
import requests

from tests.e2e.test_disconnects import assert_no_ghosts, long_prompt, random_disconnects, settled

pytestmark = pytest.mark.e2e


def test_a_thousand_random_disconnects_leave_no_ghost(tiny_server):
    url = tiny_server.url
    text = long_prompt(url)
    probe = {"inputs": text, "parameters": {"max_new_tokens": 20}}
    before = requests.post(url + "/generate", json=probe, timeout=60).json()
    kinds = asyncio.run(random_disconnects(tiny_server.port, text, n=1000, concurrency=32, seed=1234))
    assert sum(kinds.values()) == 1000 and len(kinds) >= 5, kinds
    assert_no_ghosts(settled(url, timeout=120))
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.post(url + "/generate", json=probe, timeout=60).json() == before
