"""TGI's layers: payload limit (413), API key (bare 401 on the protected routes only), CORS."""

from __future__ import annotations

import json

import pytest

from tests.services.http.fakes import FakeIngress, client, run

PROTECTED = [
    ("POST", "/"),
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
]
OPEN = [
    ("GET", "/health"),
    ("GET", "/"),
    ("GET", "/ping"),
    ("GET", "/info"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/chat_tokenize"),
    ("GET", "/docs"),
    ("GET", "/api-doc/openapi.json"),
]


def test_payload_limit_413():
    async def scenario():
        async with client(FakeIngress(), payload_limit=200) as c:
            small = await c.post("/generate", json={"inputs": "x"})
            big = await c.post("/generate", json={"inputs": "x" * 300})

            async def chunks():  # no Content-Length: the limit still holds while reading
                yield b'{"inputs": "'
                yield b"y" * 400
                yield b'"}'

            chunked = await c.post("/generate", data=chunks())
            return small.status, (big.status, await big.json()), (chunked.status, await chunked.json())

    small, big, chunked = run(scenario())
    expected = {"error": "Failed to buffer the request body: length limit exceeded", "error_type": "payload_too_large"}
    assert small == 200 and big == (413, expected) and chunked == (413, expected)


@pytest.mark.parametrize(
    "header,ok",
    [
        (None, False),
        ("Bearer s3cret-Key", True),
        ("bearer S3CRET-key", True),
        ("Bearer other", False),
        ("s3cret-Key", False),
        ("Bearer  s3cret-Key", False),
    ],
)
def test_api_key_on_protected_routes(header, ok):
    async def scenario():
        async with client(FakeIngress(), api_key="s3cret-Key") as c:
            headers = {"Authorization": header} if header else {}
            out = {}
            for method, path in PROTECTED + OPEN:
                r = await c.request(method, path, json={"inputs": "x"}, headers=headers)
                out[(method, path)] = (r.status, await r.read())
            return out

    out = run(scenario())
    for route in PROTECTED:
        status, body = out[route]
        assert (status == 401) != ok and (status != 401 or body == b""), (route, status)
    for route in OPEN:
        assert out[route][0] != 401, route


def test_no_api_key_no_check():
    async def scenario():
        async with client(FakeIngress()) as c:
            return (await c.post("/generate", json={"inputs": "x"})).status

    assert run(scenario()) == 200


def test_cors_any_origin_by_default_and_preflight():
    async def scenario():
        async with client(FakeIngress(), api_key="k") as c:
            pre = await c.options(
                "/generate",
                headers={
                    "Origin": "https://app.example",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "content-type",
                },
            )
            get = await c.get("/info", headers={"Origin": "https://app.example"})
            denied = await c.post("/generate", json={"inputs": "x"}, headers={"Origin": "https://app.example"})
            return pre, get, denied

    pre, get, denied = run(scenario())
    assert pre.status == 200  # the preflight is answered before the API key check
    assert pre.headers["Access-Control-Allow-Origin"] == "*"
    assert pre.headers["Access-Control-Allow-Methods"] == "GET,POST"
    assert pre.headers["Access-Control-Allow-Headers"] == "content-type"
    assert get.headers["Access-Control-Allow-Origin"] == "*"
    assert denied.status == 401 and denied.headers["Access-Control-Allow-Origin"] == "*"


def test_cors_origin_list():
    async def scenario():
        async with client(FakeIngress(), cors_allow_origin="https://a.example, https://b.example") as c:
            ok = await c.post("/generate", json={"inputs": "x"}, headers={"Origin": "https://b.example"})
            other = await c.post("/generate", json={"inputs": "x"}, headers={"Origin": "https://evil.example"})
            pre = await c.options(
                "/generate", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
            )
            missing = await c.get("/nope", headers={"Origin": "https://a.example"})
            return ok, other, pre, missing, json.loads(await ok.read())

    ok, other, pre, missing, body = run(scenario())
    assert ok.headers["Access-Control-Allow-Origin"] == "https://b.example" and "origin" in ok.headers["Vary"]
    assert body["generated_text"] == " Paris."
    assert "Access-Control-Allow-Origin" not in other.headers and other.status == 200
    assert "Access-Control-Allow-Origin" not in pre.headers
    assert missing.status == 404 and missing.headers["Access-Control-Allow-Origin"] == "https://a.example"
