"""A reasoning model's answer through /v1/messages: thinking block, then text, whole and streamed alike (the bus
faked; the parsers and events real)."""

from __future__ import annotations

import json

from services.http.anthropic.signature import sign
from tests.services.http.fakes import FakeIngress, client, run
from tests.services.http.responses_api.test_reasoning_output import TEMPLATE, answer

BODY = {"model": "tgi", "max_tokens": 20, "messages": [{"role": "user", "content": "capital?"}]}


def test_thinking_block_then_text():
    async def scenario():
        async with client(FakeIngress(answer), chat_template=TEMPLATE) as c:
            whole = await (await c.post("/v1/messages", json=BODY)).json()
            streamed = await (await c.post("/v1/messages", json={**BODY, "stream": True})).read()
            return whole, streamed.decode()

    whole, streamed = run(scenario())
    assert whole["content"] == [
        {"type": "thinking", "thinking": "weigh it", "signature": sign("weigh it")},
        {"type": "text", "text": "Paris."},
    ]
    assert whole["stop_reason"] == "end_turn" and whole["usage"]["output_tokens"] == 5
    names = [line[7:] for line in streamed.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert data[2]["content_block"]["type"] == "thinking"
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "weigh it"
    assert "".join(d.get("text", "") for d in deltas) == "Paris."
    # the thinking block's last delta is its signature, the non-streamed block's; then the block stops
    at = next(i for i, d in enumerate(data) if d.get("delta", {}).get("type") == "signature_delta")
    assert data[at]["delta"]["signature"] == sign("weigh it") and data[at + 1]["type"] == "content_block_stop"
    assert data[at - 1]["delta"]["type"] == "thinking_delta"
    assert data[-2]["delta"]["stop_reason"] == "end_turn"


def test_budget_tokens_is_the_thinking_budget():
    ingress = FakeIngress(answer)

    async def scenario():
        async with client(ingress, chat_template=TEMPLATE) as c:
            thinking = {"type": "enabled", "budget_tokens": 3}
            ok = await c.post("/v1/messages", json={**BODY, "thinking": thinking})
            bad = await c.post("/v1/messages", json={**BODY, "thinking": {**thinking, "budget_tokens": 0}})
            return ok.status, bad.status, await bad.json()

    ok, bad, body = run(scenario())
    assert ok == 200 and ingress.sent[0].thinking_budget == 3
    assert ingress.sent[0].chat_template_kwargs == {"enable_thinking": True}
    assert bad == 400 and body["error"]["type"] == "invalid_request_error" and len(ingress.sent) == 1
