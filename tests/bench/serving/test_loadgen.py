"""The load generator (bench/serving/loadgen.py): its statistics, SSE parsing of both dialects, the metrics parsing,
loopback only, and the closed loop against a local server."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from bench.serving import loadgen
from bench.serving.loadgen import Dialect, Job, Sample, percentile, summarize


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)  # numpy.percentile([1..5], 90) = 4.6
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None


def test_sample_ttft_and_gaps():
    s = Sample(sent=10.0, events=[10.5, 10.7, 11.0], tokens=3)
    assert s.ttft == pytest.approx(0.5)
    assert s.gaps() == pytest.approx([0.2, 0.3])
    # a server that merged 4 tokens into 2 events after the first: each gap is split over its tokens
    merged = Sample(sent=0.0, events=[1.0, 1.4, 1.8], tokens=5)
    assert merged.gaps() == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert Sample(sent=0.0, events=[1.0], tokens=1).gaps() == []


def test_summarize_throughput_and_percentiles_in_ms():
    a = Sample(sent=0.0, events=[0.1, 0.2, 0.3, 0.4], tokens=4)
    b = Sample(sent=0.0, events=[0.3, 0.5, 0.7, 0.9], tokens=4)
    bad = Sample(sent=0.0, error="HTTP 500: boom")
    out = summarize([a, b, bad], started=0.0, ended=2.0)
    assert out["requests"] == 3 and out["errors"] == 1 and out["first_error"] == "HTTP 500: boom"
    assert out["output_tokens"] == 8 and out["output_tok_s"] == pytest.approx(4.0)
    assert out["ttft_p50_ms"] == pytest.approx(200.0)  # TTFTs 100 and 300 ms
    assert out["itl_p50_ms"] == pytest.approx(150.0)  # gaps 100 ×3, 200 ×3
    assert out["itl_p99_ms"] == pytest.approx(200.0)
    empty = summarize([], 0.0, 1.0)
    assert empty["output_tok_s"] == 0 and empty["ttft_p50_ms"] is None


def test_dialects_read_their_events():
    tgi, s = Dialect("tgi"), Sample(sent=0.0)
    path, body = tgi.request(Job("hi", 2, 7))
    assert path == "/generate_stream" and body["parameters"]["max_new_tokens"] == 7
    tgi.read({"token": {"id": 5, "text": "a"}}, s, 1.0)
    tgi.read({"token": {"id": 6, "text": "b"}, "details": {"generated_tokens": 2}}, s, 2.0)
    assert s.events == [1.0, 2.0] and s.tokens == 2 and s.error is None
    tgi.read({"error": "Request failed during generation", "error_type": "generation"}, s, 3.0)
    assert s.error

    oa, s = Dialect("openai"), Sample(sent=0.0)
    path, body = oa.request(Job("hi", 2, 7))
    assert path == "/v1/completions" and body["ignore_eos"] and body["stream"] and body["max_tokens"] == 7
    oa.read({"choices": [{"text": "a"}]}, s, 1.0)
    oa.read({"choices": [{"text": "bc"}]}, s, 2.0)
    oa.read({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 2}}, s, 2.5)
    assert s.events == [1.0, 2.0] and s.tokens == 3 and s.prompt_tokens == 2


def test_metrics_parsing_for_kv_and_batch():
    text = (
        "# HELP x\n"
        'switchyard_kv_blocks_free{replica="0"} 30\n'
        'switchyard_kv_blocks_total{replica="0"} 40\n'
        'switchyard_batch_current_size{replica="0"} 3\n'
        'tgi_batch_current_size{replica="0"} 3\n'
    )
    assert loadgen.kv_and_batch(loadgen.parse_metrics(text)) == (0.25, 3.0)
    vllm = 'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_running{engine="0"} 7\n'
    assert loadgen.kv_and_batch(loadgen.parse_metrics(vllm)) == (0.5, 7.0)
    assert loadgen.kv_and_batch({}) == (None, None)
    used_free = 'switchyard_kv_blocks_used{role="scheduler"} 10\nswitchyard_kv_blocks_free{role="scheduler"} 30\n'
    assert loadgen.kv_and_batch(loadgen.parse_metrics(used_free)) == (0.25, None)


def test_only_loopback_is_driven():
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(loadgen.drive("http://10.0.0.1:80", Dialect("tgi"), [Job("x", 1, 1)], 1))


def test_drive_against_a_local_sse_server():
    """The closed loop against a real aiohttp server that streams TGI-style events with known timing."""

    async def handler(request):
        body = await request.json()
        n = body["parameters"]["max_new_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(0.01)
            event = {"token": {"id": i, "text": "x"}, "details": {"generated_tokens": n} if i == n - 1 else None}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        return resp

    async def metrics(request):
        return web.Response(text='tgi_batch_current_size{replica="0"} 2\n')

    async def go():
        app = web.Application()
        app.router.add_post("/generate_stream", handler)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            jobs = [Job("p", 1, 5) for _ in range(6)]
            return await loadgen.run_level(f"http://127.0.0.1:{port}", Dialect("tgi"), jobs, 3)
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert out["requests"] == 6 and out["errors"] == 0 and out["output_tokens"] == 30
    assert out["itl_p50_ms"] >= 9  # the server sleeps 10 ms between tokens
    assert out["ttft_p50_ms"] >= 9
    assert all(b == 2 for _, _, b in out["series"])
