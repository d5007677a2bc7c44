"""The chat path's stream (services/http/chat_path.py stream_turn), which the Messages and Responses APIs share: a
failure before the first token is an HTTP status in the API's error shape; one after it is the API's error event
that ends the stream; a stored response is kept only when its answer ended. The bus is faked
(tests.services.http.fakes); the events are the real ones."""

from __future__ import annotations

import json

from services.http.errors import Failure
from tests.services.http.fakes import FakeIngress, client, rows, run

MESSAGES = {"model": "tgi", "max_tokens": 20, "messages": [{"role": "user", "content": "capital?"}], "stream": True}
RESPONSES = {"input": "capital?", "stream": True}
LOST = "Request failed during generation: the shard died"


def failing_after_one_token(req, n):
    """One token, then the request fails; the second request (n 1) fails before any token."""
    if n == 1:
        return Failure("Model is overloaded", "overloaded")
    return [rows(req.request_id, [" Paris", "."], [-0.5, -1.0])[0], Failure(LOST, "generation")]  # not the final row


def data(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_messages_stream_ends_with_an_error_event_after_the_first_token():
    ingress = FakeIngress(failing_after_one_token)

    async def scenario():
        async with client(ingress) as c:
            mid = await c.post("/v1/messages", json=MESSAGES)
            before = await c.post("/v1/messages", json=MESSAGES)
            return mid.status, await mid.read(), before.status, await before.json()

    status, raw, before_status, before = run(scenario())
    events = data(raw)
    assert status == 200 and events[0]["type"] == "message_start"
    assert " Paris" in [e["delta"].get("text") for e in events if e["type"] == "content_block_delta"]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": LOST}}
    assert "message_stop" not in [e["type"] for e in events]
    overloaded = {"type": "rate_limit_error", "message": "Model is overloaded"}
    assert before_status == 429 and before == {"type": "error", "error": overloaded}


def test_responses_stream_ends_with_an_error_event_and_keeps_only_an_ended_response():
    ingress = FakeIngress(
        lambda req, n: (
            failing_after_one_token(req, n) if n < 2 else rows(req.request_id, ["ok"], [-1], finish="eos_token")
        )
    )

    async def scenario():
        async with client(ingress) as c:
            mid = await c.post("/v1/responses", json=RESPONSES)
            raw = await mid.read()
            before = await c.post("/v1/responses", json=RESPONSES)
            ended = data(await (await c.post("/v1/responses", json=RESPONSES)).read())
            ids = [events[0]["response"]["id"] for events in (data(raw), ended)]
            stored = [(await c.get(f"/v1/responses/{i}")).status for i in ids]
            return mid.status, data(raw), before.status, await before.json(), ended, stored

    status, events, before_status, before, ended, stored = run(scenario())
    assert status == 200 and events[0]["type"] == "response.created"
    assert " Paris" in [e.get("delta") for e in events if e["type"] == "response.output_text.delta"]
    assert events[-1]["type"] == "error" and events[-1]["message"] == LOST and events[-1]["code"] == "generation"
    assert "response.completed" not in [e["type"] for e in events]
    assert before_status == 429 and before["error"]["message"] == "Model is overloaded"
    assert ended[-1]["type"] == "response.completed"
    assert stored == [404, 200]  # the failed response was not kept; the ended one was
