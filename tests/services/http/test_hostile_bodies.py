"""The HTTP layer alone (bus faked) under hostile bodies: JSON nested 100k deep on every route is TGI's 400 (not
a RecursionError 500), and an error no handler expected still answers in TGI's JSON error shape."""

from __future__ import annotations

import pytest

from tests.services.http.fakes import FakeIngress, client, run

DEEP = 100_000
ARRAYS = b"[" * DEEP + b"]" * DEEP
OBJECTS = b'{"a":' * DEEP + b"1" + b"}" * DEEP
ROUTES = ["/", "/generate", "/generate_stream", "/invocations", "/tokenize", "/chat_tokenize"]
ROUTES += ["/v1/chat/completions", "/v1/completions"]
BODIES = {
    "unknown field": lambda nest: b'{"inputs": "hi", "messages": [], "prompt": "hi", "x": ' + nest + b"}",
    "whole body": lambda nest: nest,
}


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("shape", sorted(BODIES))
@pytest.mark.parametrize("nest", [ARRAYS, OBJECTS], ids=["arrays", "objects"])
def test_deep_nesting_is_a_json_4xx(path, shape, nest):
    async def scenario():
        async with client(FakeIngress(), payload_limit=10_000_000) as c:
            r = await c.post(path, data=BODIES[shape](nest), headers={"Content-Type": "application/json"})
            return r.status, await r.json()

    status, body = run(scenario())
    assert status in (400, 422), (status, body)
    assert set(body) == {"error", "error_type"} and body["error_type"] == "validation", body
    if path != "/invocations" and shape == "unknown field":  # msgspec recursed: the depth message
        assert body == {
            "error": "Failed to parse the request body as JSON: recursion limit exceeded",
            "error_type": "validation",
        }


def test_an_unexpected_error_is_a_json_500():
    def broken(req, n):
        raise KeyError("a bug")

    async def scenario():
        async with client(FakeIngress(answer=broken)) as c:
            r = await c.post("/generate", json={"inputs": "hi"})
            ok = await c.get("/info")
            return r.status, r.headers["Content-Type"], await r.json(), ok.status

    status, ctype, body, after = run(scenario())
    assert (status, body, after) == (500, {"error": "Internal server error", "error_type": "internal"}, 200)
    assert ctype.startswith("application/json")


def test_a_body_the_bus_cannot_carry_is_a_422():
    """Chat messages and tools travel as sent; an int past 64 bits in them cannot be msgpack-encoded."""
    from libs.protocol import codec
    from tests.services.http.fakes import rows

    def encode_then_answer(req, n):
        codec.encode(req)  # what the real ingress does before anything else
        return rows(req.request_id, ["ok"], [-0.1])

    big = {"messages": [{"role": "user", "content": "hi", "name": "x", "extra": 2**70}], "max_tokens": 2}

    async def scenario():
        async with client(FakeIngress(answer=encode_then_answer)) as c:
            out = []
            for path in ("/v1/chat/completions", "/invocations"):
                r = await c.post(path, json=big)
                out.append((r.status, await r.json()))
            return out

    for status, body in run(scenario()):
        assert status == 422 and body["error_type"] == "validation", body
        assert body["error"].startswith("Failed to deserialize the JSON body into the target type"), body
