"""Reasoning apart, end to end with the openai SDK: a tiny model served with a DeepSeek-R1-style template (its
generation prompt opens `<think>`): the answer comes back as reasoning_content / reasoning, streamed alike, and a
thinking budget makes the server write `</think>` itself so that an answer follows."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "deepseek_r1.jinja"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "reasoning.log"
    with Server(tiny_model_dir, log, "--max-total-tokens", "512", "--chat-template", str(TEMPLATE)) as s:
        yield OpenAI(base_url=s.url + "/v1", api_key="-")


def _streamed(client, **kw) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in client.chat.completions.create(model="tgi", messages=ASK, stream=True, **kw):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    return reasoning, content


def test_reasoning_apart_and_a_thinking_budget(client):
    # no budget: a random model never closes its reasoning, so all of it is reasoning
    free = client.chat.completions.create(model="tgi", messages=ASK, max_tokens=12, temperature=0).choices[0]
    assert free.message.reasoning_content and free.message.content == ""
    assert free.message.model_extra["reasoning"] == free.message.reasoning_content
    assert _streamed(client, max_tokens=12, temperature=0) == (free.message.reasoning_content, "")
    # a budget of 3 tokens: the server writes `</think>` and the answer follows
    kw = dict(max_tokens=24, temperature=0, extra_body={"thinking_token_budget": 3})
    budgeted = client.chat.completions.create(model="tgi", messages=ASK, **kw).choices[0]
    assert budgeted.message.reasoning_content is not None
    assert budgeted.message.content, "no answer after the reasoning: the end marker was not forced"
    assert len(budgeted.message.reasoning_content) < len(free.message.reasoning_content)
    assert _streamed(client, **kw) == (budgeted.message.reasoning_content, budgeted.message.content)
    with pytest.raises(openai.UnprocessableEntityError, match="reasoning_effort"):
        client.chat.completions.create(model="tgi", messages=ASK, max_tokens=4, reasoning_effort="enormous")
    # effort `none`: a budget of 0, so the server writes `</think>` at once and all of the answer is content
    none = client.chat.completions.create(
        model="tgi", messages=ASK, max_tokens=8, temperature=0, reasoning_effort="none"
    )
    assert not none.choices[0].message.reasoning_content and none.choices[0].message.content


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_a_response_format_constrains_only_the_answer(client):
    # reasoning free up to the budget, then `</think>`, then JSON valid for the schema (not the whole output: then
    # all of it would sit inside the reasoning the prompt opened and the content would be empty)
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    kw = dict(max_tokens=40, temperature=0, response_format=fmt, extra_body={"thinking_token_budget": 3})
    choice = client.chat.completions.create(model="tgi", messages=ASK, **kw).choices[0]
    assert choice.message.reasoning_content
    verdict = json.loads(choice.message.content)
    assert set(verdict) == {"ok"} and isinstance(verdict["ok"], bool)
    assert _streamed(client, **kw) == (choice.message.reasoning_content, choice.message.content)
    # the same through the Responses API's text.format (its reasoning.effort: the budget)
    response = client.responses.create(
        model="tgi",
        input="Why is the sky blue?",
        max_output_tokens=300,
        temperature=0,
        reasoning={"effort": "minimal"},  # 256 tokens
        text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA}},
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert set(json.loads(response.output_text)) == {"ok"}
