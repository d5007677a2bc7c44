"""TGI's routes over a fake bus: response shapes, best_of, the permit, tokenize, invocations, info."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from libs.runtime.settings import Settings
from services.http.errors import Failure
from services.http.generation import Permits
from services.http.tgi.routes import Routes
from tests.services.http.fakes import FakeIngress, client, rows, run

PROMPT = "The capital"


def sse_events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


async def post(ingress, path, body, **settings):
    async with client(ingress, **settings) as c:
        r = await c.post(path, json=body)
        return r.status, (await r.read()), r.headers


def test_generate_details_prefill_and_top_tokens():
    ingress = FakeIngress(
        lambda req, n: rows(req.request_id, [" Paris", "!"], [-0.5, -1.25], top_n=2, prefill=True, seed=7)
    )
    params = {"details": True, "decoder_input_details": True, "top_n_tokens": 2, "max_new_tokens": 2}
    status, raw, _ = run(post(ingress, "/generate", {"inputs": PROMPT, "parameters": params}))
    assert status == 200
    out = json.loads(raw)
    assert out["generated_text"] == " Paris!"
    details = out["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens"]
    assert (details["finish_reason"], details["generated_tokens"], details["seed"]) == ("length", 2, 7)
    assert details["prefill"] == [
        {"id": 2, "text": "<bos>", "logprob": None},
        {"id": 651, "text": "The", "logprob": -2.5},
        {"id": 6037, "text": " capital", "logprob": -0.75},
    ]
    assert details["tokens"] == [
        {"id": 100, "text": " Paris", "logprob": -0.5, "special": False},
        {"id": 101, "text": "!", "logprob": -1.25, "special": False},
    ]
    assert [[t["logprob"] for t in alts] for alts in details["top_tokens"]] == [[-0.5, -1.5], [-1.25, -2.25]]
    wire = ingress.sent[0].parameters
    assert (wire.decoder_input_details, wire.top_n_tokens, wire.details) == (True, 2, True)


def test_details_only_when_asked():
    status, raw, _ = run(post(FakeIngress(), "/generate", {"inputs": PROMPT, "parameters": {}}))
    assert json.loads(raw) == {"generated_text": " Paris."}
    # decoder_input_details alone asks for details too (TGI: details || decoder_input_details)
    _, raw, _ = run(post(FakeIngress(), "/generate", {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}))
    details = json.loads(raw)["details"]
    assert "top_tokens" not in details and "best_of_sequences" not in details and details["prefill"] == []


def test_generate_timing_headers():
    _, _, headers = run(post(FakeIngress(), "/generate", {"inputs": PROMPT, "parameters": {"details": True}}))
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(headers[name]) >= 0, name
    assert float(headers["x-compute-time"]) >= 0
    assert headers["x-compute-characters"] == str(len(PROMPT))
    assert (headers["x-prompt-tokens"], headers["x-generated-tokens"]) == ("3", "2")
    assert headers["x-compute-type"]


def test_stream_events_top_tokens_and_details():
    ingress = FakeIngress(lambda req, n: rows(req.request_id, [" Paris", "!"], [-0.5, -1.25], top_n=1, seed=3))
    body = {"inputs": PROMPT, "parameters": {"details": True, "top_n_tokens": 1, "return_full_text": True}}
    status, raw, headers = run(post(ingress, "/generate_stream", body))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-compute-characters"] == str(len(PROMPT)) and headers["X-Accel-Buffering"] == "no"
    assert "x-compute-type" in headers
    first, last = sse_events(raw)
    assert first == {
        "index": 1,
        "token": {"id": 100, "text": " Paris", "logprob": -0.5, "special": False},
        "top_tokens": [{"id": 100, "text": "alt0", "logprob": -0.5, "special": False}],
        "generated_text": None,
        "details": None,
    }
    assert last["generated_text"] == PROMPT + " Paris!"
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 2, "seed": 3, "input_length": 3}
    assert ingress.sent[0].stream is True
    # no alternatives: the key is omitted; no details asked: null on the last event too
    _, raw, _ = run(post(FakeIngress(), "/generate_stream", {"inputs": PROMPT, "parameters": {}}))
    events = sse_events(raw)
    assert all("top_tokens" not in e for e in events) and events[-1]["details"] is None
    assert events[-1]["generated_text"] == " Paris."


def test_stream_error_in_stream_with_200():
    ingress = FakeIngress(
        lambda req, n: Failure(
            "Input validation error: `best_of` != 1 is not supported when streaming tokens", "validation"
        )
    )
    status, raw, _ = run(post(ingress, "/generate_stream", {"inputs": PROMPT, "parameters": {"best_of": 2}}))
    assert status == 200
    assert sse_events(raw) == [
        {
            "error": "Input validation error: `best_of` != 1 is not supported when streaming tokens",
            "error_type": "validation",
        }
    ]
    assert len(ingress.sent) == 1  # a stream is never fanned out


def test_compat_route_list_full_text_and_stream():
    ingress = FakeIngress()
    _, raw, _ = run(post(ingress, "/", {"inputs": PROMPT}))
    assert json.loads(raw) == [{"generated_text": PROMPT + " Paris."}]  # return_full_text defaults true here
    assert ingress.sent[0].parameters.do_sample is True  # omitted `parameters`: TGI's default_parameters()
    _, raw, _ = run(post(ingress, "/", {"inputs": PROMPT, "stream": True, "parameters": {"return_full_text": False}}))
    assert sse_events(raw)[-1]["generated_text"] == " Paris."


def _best_of_answer(req, n):
    # request 0 scores -1.0 on average, request 1 -0.25: the second one wins
    if n == 0:
        return rows(req.request_id, [" Lyon", "."], [-1.5, -0.5], seed=11)
    return rows(req.request_id, [" Paris", "."], [-0.25, -0.25], seed=22)


def test_best_of_picks_best_mean_logprob():
    ingress = FakeIngress(_best_of_answer)
    body = {
        "inputs": PROMPT,
        "parameters": {"best_of": 2, "do_sample": True, "details": True, "return_full_text": True},
    }
    status, raw, _ = run(post(ingress, "/generate", body))
    assert status == 200
    out = json.loads(raw)
    assert out["generated_text"] == PROMPT + " Paris." and out["details"]["seed"] == 22
    (other,) = out["details"]["best_of_sequences"]
    assert other["generated_text"] == PROMPT + " Lyon." and other["seed"] == 11
    assert [t["text"] for t in other["tokens"]] == [" Lyon", "."]
    assert set(other) == {"generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert len(ingress.sent) == 2 and len({r.request_id for r in ingress.sent}) == 2
    assert all(r.parameters.best_of == 2 for r in ingress.sent)
    # without details: only the best text
    _, raw, _ = run(
        post(FakeIngress(_best_of_answer), "/generate", {**body, "parameters": {"best_of": 2, "do_sample": True}})
    )
    assert json.loads(raw) == {"generated_text": " Paris."}


def test_best_of_first_failure_wins_and_aborts_the_rest():
    async def scenario():
        ingress = FakeIngress(
            lambda req, n: (
                Failure("Request failed during generation: boom", "generation")
                if n == 1
                else rows(req.request_id, ["x"], [-1.0])
            )
        )
        ingress.gate = asyncio.Event()  # request 0 never gets its rows
        async with client(ingress) as c:
            r = await c.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
            return r.status, await r.json(), ingress

    status, body, ingress = run(scenario())
    assert (status, body) == (424, {"error": "Request failed during generation: boom", "error_type": "generation"})
    assert ingress.closed == [ingress.sent[0].request_id]  # the one still running was closed (aborted)


def test_best_of_over_the_limit_is_not_fanned_out():
    ingress = FakeIngress(
        lambda req, n: Failure("Input validation error: `best_of` must be > 0 and <= 2. Given: 5", "validation")
    )
    status, raw, _ = run(
        post(ingress, "/generate", {"inputs": PROMPT, "parameters": {"best_of": 5, "do_sample": True}})
    )
    assert status == 422 and len(ingress.sent) == 1


def test_permit_429_on_every_generation_route():
    async def scenario():
        ingress = FakeIngress()
        ingress.gate = asyncio.Event()
        async with client(ingress, max_concurrent_requests=2) as c:
            held = asyncio.create_task(c.post("/generate", json={"inputs": PROMPT}))
            while len(ingress.sent) < 1:
                await asyncio.sleep(0.01)
            # best_of 2 needs 2 permits, 1 is free
            r1 = await c.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
            held2 = asyncio.create_task(c.post("/generate", json={"inputs": PROMPT}))
            while len(ingress.sent) < 2:
                await asyncio.sleep(0.01)
            r2 = await c.post("/generate", json={"inputs": PROMPT})
            r3 = await c.post("/generate_stream", json={"inputs": PROMPT})
            r4 = await c.post("/", json={"inputs": PROMPT})
            out = [(r.status, await r.read()) for r in (r1, r2, r3, r4)]
            ingress.gate.set()
            assert (await held).status == 200 and (await held2).status == 200
            return out

    (s1, b1), (s2, b2), (s3, b3), (s4, b4) = run(scenario())
    overloaded = {"error": "Model is overloaded", "error_type": "overloaded"}
    assert (s1, json.loads(b1)) == (429, overloaded)
    assert (s2, json.loads(b2)) == (429, overloaded)
    assert (s3, sse_events(b3)) == (200, [overloaded])  # in-stream, as TGI
    assert (s4, json.loads(b4)) == (429, overloaded)


def test_tokenize_byte_offsets_and_no_validation():
    ingress = FakeIngress()
    status, raw, _ = run(post(ingress, "/tokenize", {"inputs": "a bé c", "parameters": {"top_p": 1.0}}))
    assert status == 200
    assert json.loads(raw) == [
        {"id": 0, "text": "a", "start": 0, "stop": 1},
        {"id": 1, "text": " bé", "start": 1, "stop": 5},
        {"id": 2, "text": " c", "start": 5, "stop": 7},
    ]
    assert ingress.sent[0].mode == "tokenize"


def test_invocations_dispatch_by_shape():
    calls = []

    class OpenAI:
        async def chat(self, request):
            calls.append(("chat", await request.json()))
            return web.json_response({"object": "chat.completion"})

        async def completions(self, request):
            calls.append(("completions", await request.json()))
            return web.json_response({"object": "text_completion"})

    async def scenario():
        settings = Settings(model_id="org/tiny")
        app = web.Application()
        Routes(settings, FakeIngress(), Permits(4), OpenAI()).install(app)
        async with TestClient(TestServer(app)) as c:
            out = []
            for body in (
                {"inputs": PROMPT},
                {"messages": [{"role": "user", "content": "hi"}]},
                {"prompt": "x"},
                {"nope": 1},
            ):
                r = await c.post("/invocations", json=body)
                out.append((r.status, await r.json()))
            return out

    compat, chat, completion, bad = run(scenario())
    assert compat == (200, [{"generated_text": PROMPT + " Paris."}])
    assert chat == (200, {"object": "chat.completion"}) and completion == (200, {"object": "text_completion"})
    assert [c[0] for c in calls] == ["chat", "completions"] and calls[0][1]["messages"][0]["content"] == "hi"
    assert bad[0] == 422 and "untagged enum SagemakerRequest" in bad[1]["error"]


def test_info_models_health_docs():
    async def scenario():
        async with client(FakeIngress(), model_sha="abc") as c:
            return [
                (r.status, await r.read())
                for r in [await c.get(p) for p in ("/info", "/v1/models", "/health", "/ping", "/", "/docs", "/metrics")]
            ]

    (si, info), (sm, models), *health, (sd, docs), (sx, _) = run(scenario())
    info = json.loads(info)
    # TGI's fields in TGI's order; model_dtype is ours, after them
    assert list(info) == [
        "model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of", "max_stop_sequences",
        "max_input_tokens", "max_total_tokens", "validation_workers", "max_client_batch_size", "router", "version",
        "sha", "docker_label", "model_dtype",
    ]  # fmt: skip
    assert (info["model_id"], info["model_sha"], info["version"]) == ("org/tiny", "abc", "3.3.6-dev0")
    assert info["model_dtype"] == "auto"  # what the settings say: the launcher puts its resolved choice there
    assert json.loads(models) == {
        "object": "list",
        "data": [{"id": "org/tiny", "object": "model", "created": 0, "owned_by": "org/tiny"}],
    }
    assert health == [(200, b"")] * 3
    assert sd == 200 and b"/api-doc/openapi.json" in docs and b"SwaggerUIBundle" in docs
    assert sx == 200
