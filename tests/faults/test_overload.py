"""Overload: far more clients than --max-concurrent-requests. Those beyond the limit get an immediate 429 `Model
is overloaded`; the admitted ones are unaffected (greedy output equal to the same request served alone), and
once the flood is over the scheduler holds no request and every KV block is free."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import requests

from tests.e2e.server import Server
from tests.e2e.test_disconnects import assert_no_ghosts, settled

pytestmark = pytest.mark.e2e

LIMIT = 4
OVERLOADED = {"error": "Model is overloaded", "error_type": "overloaded"}


@pytest.fixture(scope="module")
def small_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "overload-server.log"
    with Server(tiny_model_dir, log, "--max-total-tokens", "512", "--max-concurrent-requests", str(LIMIT)) as server:
        yield server


def test_flood_beyond_the_limit(small_server):
    url = small_server.url
    prompts = [f"request number {i} says" for i in range(8)]
    alone = {}
    for p in prompts:
        body = {"inputs": p, "parameters": {"max_new_tokens": 40}}
        alone[p] = requests.post(url + "/generate", json=body, timeout=60).json()["generated_text"]

    async def one(session, i):
        p = prompts[i % len(prompts)]
        started = time.monotonic()
        async with session.post(url + "/generate", json={"inputs": p, "parameters": {"max_new_tokens": 40}}) as r:
            return p, r.status, await r.json(), time.monotonic() - started

    async def flood():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(300)))

    results = asyncio.run(flood())
    ok = [(p, body) for p, status, body, _ in results if status == 200]
    refused = [(body, took) for _, status, body, took in results if status == 429]
    assert len(ok) + len(refused) == len(results), {s for _, s, _, _ in results}
    assert len(ok) >= LIMIT and refused, (len(ok), len(refused))
    assert all(body == OVERLOADED for body, _ in refused)
    assert max(took for _, took in refused) < 5.0  # refused at once, not queued behind the admitted ones
    for p, body in ok:
        assert body["generated_text"] == alone[p], p
    assert_no_ghosts(settled(url))
