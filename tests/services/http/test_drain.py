"""The http drain state: refusals in each API's shape, readiness 503, in-flight counting, the timeout."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.http.drain import MESSAGE, Drain


async def _client(drain: Drain, release: asyncio.Event, started: asyncio.Event) -> TestClient:
    async def slow(request):
        started.set()
        await release.wait()
        return web.json_response({"generated_text": "done"})

    async def health(request):
        return web.Response(status=200)

    app = web.Application(middlewares=[drain.middleware])
    app.router.add_post("/generate", slow)
    app.router.add_post("/v1/chat/completions", slow)
    app.router.add_post("/v1/messages", slow)

    async def metrics(request):
        return web.Response(body=b"tgi_queue_size 0\n", content_type="text/plain")

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def test_running_request_finishes_new_ones_refused_in_their_shape():
    async def go():
        drain, release, started = Drain(), asyncio.Event(), asyncio.Event()
        client = await _client(drain, release, started)
        try:
            assert (await client.get("/health")).status == 200
            running = asyncio.ensure_future(client.post("/generate", json={}))
            await started.wait()
            assert drain.in_flight == 1
            drain.begin()
            assert "switchyard_draining 1" in drain.metrics_text()
            health = await client.get("/health")
            assert health.status == 503
            tgi = await client.post("/generate", json={})
            assert tgi.status == 503
            assert json.loads(await tgi.read()) == {"error": MESSAGE, "error_type": "unavailable"}
            openai = await client.post("/v1/chat/completions", json={})
            assert openai.status == 503
            assert json.loads(await openai.read())["error"]["message"] == MESSAGE
            anthropic = await client.post("/v1/messages", json={})
            assert anthropic.status == 503
            assert json.loads(await anthropic.read())["error"]["type"] == "overloaded_error"
            assert drain.refused == 3
            scraped = await (await client.get("/metrics")).text()
            assert "tgi_queue_size 0" in scraped and "switchyard_draining 1" in scraped
            assert "switchyard_drain_refused_total 3" in scraped
            assert not await drain.wait_idle(0.05)  # the first request still runs
            release.set()
            assert await drain.wait_idle(5)
            response = await running
            assert response.status == 200
            assert json.loads(await response.read()) == {"generated_text": "done"}
            assert drain.in_flight == 0
        finally:
            release.set()
            await client.close()

    asyncio.run(go())


def test_idle_drain_returns_at_once_and_counts_nothing():
    async def go():
        drain = Drain()
        assert "switchyard_draining 0" in drain.metrics_text()
        drain.begin()
        assert await drain.wait_idle(0)
        assert drain.refused == 0

    asyncio.run(go())


def test_liveness_stays_200_while_readiness_turns_503():
    async def go():
        drain, release, started = Drain(), asyncio.Event(), asyncio.Event()
        client = await _client(drain, release, started)
        try:
            assert (await client.get("/livez")).status == 200
            drain.begin()
            assert (await client.get("/health")).status == 503  # readiness: out of the Service
            assert (await client.get("/livez")).status == 200  # liveness: not restarted while it drains
        finally:
            await client.close()

    asyncio.run(go())
