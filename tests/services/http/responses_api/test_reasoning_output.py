"""A reasoning model's answer through /v1/responses: the reasoning (opened by the template's generation prompt)
comes back as a reasoning item, the rest as the message, whole and streamed alike. The bus is faked
(tests.services.http.fakes); the parsers and the events are the real ones."""

from __future__ import annotations

import json

from tests.services.http.fakes import FakeIngress, client, rows, run

# the generation prompt opens the reasoning, as DeepSeek-R1's template does
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}{# an answer's reasoning ends at </think> #}"
)
PIECES = ["weigh", " it", "</think>", "Paris", "."]


def answer(req, n):
    return rows(req.request_id, PIECES, [-0.5] * len(PIECES), finish="eos_token")


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_reasoning_item_then_message():
    async def scenario():
        async with client(FakeIngress(answer), chat_template=TEMPLATE) as c:
            whole = await (await c.post("/v1/responses", json={"input": "capital?"})).json()
            streamed = await (await c.post("/v1/responses", json={"input": "capital?", "stream": True})).read()
            return whole, events(streamed)

    whole, streamed = run(scenario())
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "weigh it"}]
    assert whole["output"][1]["content"][0]["text"] == "Paris." and whole["status"] == "completed"
    kinds = [e["type"] for e in streamed]
    assert kinds[2:4] == ["response.output_item.added", "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") == "weigh it"
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == "Paris."
    final = streamed[-1]["response"]
    assert kinds[-1] == "response.completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))


def test_reasoning_effort_is_the_thinking_budget():
    ingress = FakeIngress(answer)

    async def scenario():
        async with client(ingress, chat_template=TEMPLATE) as c:
            low = await c.post("/v1/responses", json={"input": "q", "reasoning": {"effort": "low"}})
            bad = await c.post("/v1/responses", json={"input": "q", "reasoning": {"effort": "extreme"}})
            return low.status, bad.status, await bad.json()

    low, bad, body = run(scenario())
    assert low == 200 and ingress.sent[0].thinking_budget == 1024  # the chat's reasoning_effort table (README)
    assert bad == 422 and "reasoning_effort" in body["error"]["message"] and len(ingress.sent) == 1
