"""The server's limits and flags, on one server started with them (conftest `limits_server`): --api-key (bare 401
on exactly TGI's protected routes), --payload-limit (413), --max-concurrent-requests (an immediate 429 `Model is
overloaded`, in-stream on SSE routes; best_of N and N completion prompts take N permits), --cors-allow-origin,
and --chat-template (the override, a continued final assistant message, template errors)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import requests

from tests.e2e.conftest import ALLOWED_ORIGIN, API_KEY, PAYLOAD_LIMIT, sse_events
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OVERLOADED = {"error": "Model is overloaded", "error_type": "overloaded"}
CHAT = [{"role": "user", "content": "the quick brown fox"}]

PROTECTED = [
    ("/", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/tokenize", {"inputs": "hi"}),
]


@pytest.mark.parametrize("path,body", PROTECTED, ids=[p for p, _ in PROTECTED])
def test_api_key_guards_the_generation_routes(limits_server, path, body):
    url = limits_server.url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = requests.post(url, json=body, headers=headers, timeout=30)
        assert (r.status_code, r.content) == (401, b""), headers
    # TGI lowercases both sides: the scheme and the key match in any case
    r = requests.post(url, json=body, headers={"Authorization": f"bearer {API_KEY.upper()}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_info_routes_need_no_key(limits_server):
    for path in ("/health", "/ping", "/", "/info", "/metrics", "/v1/models"):
        assert requests.get(limits_server.url + path, timeout=10).status_code == 200, path
    r = requests.post(limits_server.url + "/chat_tokenize", json={"messages": CHAT}, timeout=30)
    assert r.status_code == 200, r.text


def test_payload_limit(limits_server):
    url = limits_server.url + "/generate"
    big = json.dumps({"inputs": "a" * PAYLOAD_LIMIT}).encode()
    r = requests.post(url, data=big, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "length limit exceeded" in r.text, r.text
    # without a Content-Length (chunked), the limit holds while reading
    chunks = iter([big[i : i + 1000] for i in range(0, len(big), 1000)])
    r = requests.post(url, data=chunks, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    small = {"inputs": "a " * 100, "parameters": {"max_new_tokens": 2}}
    assert requests.post(url, json=small, headers=AUTH, timeout=30).status_code == 200


def test_cors(limits_server):
    pre = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"}
    pre["Access-Control-Request-Headers"] = "content-type"
    r = requests.options(limits_server.url + "/generate", headers=pre, timeout=10)
    assert r.status_code in (200, 204), r.text
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"].upper()
    assert "content-type" in r.headers["access-control-allow-headers"].lower()
    r = requests.get(limits_server.url + "/info", headers={"Origin": ALLOWED_ORIGIN}, timeout=10)
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = requests.get(limits_server.url + "/info", headers={"Origin": "https://evil.example"}, timeout=10)
    assert r.headers.get("access-control-allow-origin") not in ("*", "https://evil.example")


@pytest.fixture(scope="module")
def long_prompt(limits_server):
    """A prompt that greedily runs 400 tokens with no EOS: a stream of it holds its permit for a while."""
    for i in range(40):
        text = f"{i} wizards hum " + "old songs " * (i % 7)
        body = {"inputs": text, "parameters": {"max_new_tokens": 400, "details": True}}
        out = requests.post(limits_server.url + "/generate", json=body, headers=AUTH, timeout=120).json()
        if out["details"]["finish_reason"] == "length":
            return text
    raise AssertionError("no prompt runs to 400 tokens")


async def _open_stream(session, url: str, text: str):
    """Start a long stream and read its first event: from then on it holds a permit."""
    body = {"inputs": text, "parameters": {"max_new_tokens": 400}}
    r = await session.post(url + "/generate_stream", json=body, headers=AUTH)
    assert r.status == 200
    first = await r.content.readline()
    assert first.startswith(b"data:") and b'"token"' in first, first
    return r


async def _post(session, url: str, path: str, body: dict):
    async with session.post(url + path, json=body, headers=AUTH) as r:
        return r.status, await r.read()


def test_overload_is_an_immediate_429(limits_server, long_prompt):
    url = limits_server.url
    gen = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            a = await _open_stream(s, url, long_prompt)
            # one permit left: best_of 2 and two completion prompts need two each (TGI's semaphore per generate)
            status, body = await _post(
                s,
                url,
                "/generate",
                {"inputs": "hi", "parameters": {**gen["parameters"], "best_of": 2, "do_sample": True}},
            )
            assert (status, json.loads(body)) == (429, OVERLOADED)
            status, body = await _post(s, url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
            assert (status, json.loads(body)) == (429, OVERLOADED)
            assert (await _post(s, url, "/generate", gen))[0] == 200  # one request fits
            b = await _open_stream(s, url, long_prompt)  # now both permits are held
            started = time.monotonic()
            status, body = await _post(s, url, "/generate", gen)
            assert (status, json.loads(body)) == (429, OVERLOADED)
            assert time.monotonic() - started < 1.0  # immediate, not queued
            status, body = await _post(s, url, "/", gen)
            assert (status, json.loads(body)) == (429, OVERLOADED)
            status, body = await _post(s, url, "/generate_stream", gen)
            assert (status, sse_events(body)) == (200, [OVERLOADED])
            status, body = await _post(s, url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
            assert (status, json.loads(body)) == (429, OVERLOADED)
            chat_stream = {"messages": CHAT, "max_tokens": 2, "stream": True}
            status, body = await _post(s, url, "/v1/chat/completions", chat_stream)
            events = sse_events(body)
            assert status == 200 and events[-1] == "[DONE]" and len(events) == 2, events
            assert events[0]["error"] == {"message": "Model is overloaded", "http_status_code": 422}
            # routes that take no permit still answer
            assert (await _post(s, url, "/tokenize", {"inputs": "hi"}))[0] == 200
            async with s.get(url + "/health") as r:
                assert r.status == 200
            a.close()
            b.close()
            # the disconnects give the permits back
            deadline = time.monotonic() + 10
            while (await _post(s, url, "/generate", gen))[0] != 200:
                assert time.monotonic() < deadline, "permits not released after the clients left"
                await asyncio.sleep(0.2)

    asyncio.run(scenario())


def test_chat_template_override_and_continued_message(limits_server, tiny_model_dir, tiny_tokenizer):
    url = limits_server.url
    r = requests.post(url + "/chat_tokenize", json={"messages": CHAT}, timeout=30).json()
    assert r["templated_text"] == "<|user|>the quick brown fox<|end|>\n<|assistant|>"
    ids = tiny_tokenizer(r["templated_text"], add_special_tokens=False).input_ids
    assert [t["id"] for t in r["tokenize_response"]] == ids
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
    content = requests.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    expected = tiny_tokenizer.decode(reference_generate(tiny_model_dir, ids, 6), skip_special_tokens=True)
    assert content["choices"][0]["message"]["content"] == expected.replace("\ufffd", "")
    # a final assistant message is continued: the prompt ends right after its content
    cont = [*CHAT, {"role": "assistant", "content": "Once upon a  "}]
    r = requests.post(url + "/chat_tokenize", json={"messages": cont}, timeout=30).json()
    assert r["templated_text"] == "<|user|>the quick brown fox<|end|>\n<|assistant|>Once upon a"


def test_template_errors(limits_server):
    body = {"messages": [*CHAT, {"role": "tool", "content": "42"}], "max_tokens": 2}
    for extra in ({}, {"stream": True}):  # template errors come before the stream: a real 422 either way
        r = requests.post(limits_server.url + "/v1/chat/completions", json={**body, **extra}, headers=AUTH)
        assert r.status_code == 422, r.text
        err = r.json()
        assert err["error_type"] == "template_error" and err["error"].startswith("Template error: "), err
        assert "tool messages are not supported here" in err["error"]
    r = requests.post(limits_server.url + "/chat_tokenize", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["error_type"] == "template_error"
