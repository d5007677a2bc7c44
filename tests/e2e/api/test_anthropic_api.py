"""Anthropic's Messages API through the `anthropic` SDK, unmodified, on the tiny model: messages.create and
messages.stream against transformers' greedy output on the same chat template, stop_sequences, tools forced
(any, tool), a short agent loop (tool_use → tool_result → answer), count_tokens against the template's own count,
structured outputs (output_config.format), and bad input answered in Anthropic's error shape while the server keeps
serving."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pydantic
import pytest
import requests

from tests.e2e.api.test_responses_api import greedy_text
from tests.e2e.test_structured_output import TOOL_PARAMS, TOOL_PROMPT, TOOLS

pytestmark = pytest.mark.e2e

N = 8
SYSTEM = "you hum old songs"
ASK = "the quick brown fox"
# this SDK's create() has no temperature argument (the API still takes it): greedy goes in the body
GREEDY = {"temperature": 0}
# TGI's tool prompt, short: the tiny server's prompts are limited to 400 tokens
EXTRA = {"tool_prompt": TOOL_PROMPT, **GREEDY}
A_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture(scope="module")
def client(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="-")


def test_create_and_stream_equal_transformers(client, tiny_model_dir, tiny_tokenizer):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    expected = greedy_text(tiny_model_dir, tiny_tokenizer, messages)
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_tokens = len(tiny_tokenizer(rendered, add_special_tokens=False).input_ids)
    kwargs = dict(model="tgi", system=SYSTEM, max_tokens=N, extra_body=GREEDY)
    m = client.messages.create(messages=[{"role": "user", "content": ASK}], **kwargs)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == N and m.usage.input_tokens == prompt_tokens
    assert m.id.startswith("msg_") and m.role == "assistant"

    blocks = [{"role": "user", "content": [{"type": "text", "text": ASK}]}]
    with client.messages.stream(messages=blocks, **kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == prompt_tokens and final.usage.output_tokens == N

    counted = client.messages.count_tokens(model="tgi", system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == prompt_tokens


def test_stop_sequences(client):
    base = client.messages.create(
        model="tgi", messages=[{"role": "user", "content": ASK}], max_tokens=N, extra_body=GREEDY
    )
    text = base.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    m = client.messages.create(
        model="tgi", messages=[{"role": "user", "content": ASK}], max_tokens=N, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text) and stop in m.content[0].text


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_create_and_stream(client, choice):
    kwargs = dict(
        model="tgi", messages=[{"role": "user", "content": "the weather please"}], tools=A_TOOLS, tool_choice=choice,
        max_tokens=80, extra_body=EXTRA,
    )  # fmt: skip
    m = client.messages.create(**kwargs)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    use = uses[0]
    assert use.name in TOOL_PARAMS and use.id.startswith("toolu_")
    jsonschema.validate(use.input, TOOL_PARAMS[use.name])
    if choice["type"] == "tool":
        assert use.name == "get_weather"
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(use.name, use.input)] and final.stop_reason == "tool_use"


def test_agent_loop(client):
    """tool_use → the tool's result → an answer, the conversation sent whole each turn as a framework does."""
    ask = [{"role": "user", "content": "the weather please"}]
    first = client.messages.create(
        model="tgi", messages=ask, tools=A_TOOLS, tool_choice={"type": "any"}, max_tokens=80,
        extra_body=EXTRA,
    )  # fmt: skip
    use = next(b for b in first.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"sky": "clear"})}
    conversation = [*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(
        model="tgi", messages=conversation, tools=A_TOOLS, tool_choice={"type": "none"}, max_tokens=N,
        extra_body=EXTRA,
    )  # fmt: skip
    assert [b.type for b in second.content] == ["text"] and second.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(
        model="tgi", messages=conversation, tools=A_TOOLS, tool_choice={"type": "none"}, extra_body=EXTRA
    )
    alone = client.messages.count_tokens(
        model="tgi", messages=ask, tools=A_TOOLS, tool_choice={"type": "none"}, extra_body=EXTRA
    )
    # the call and its result are in the prompt
    assert counted.input_tokens == second.usage.input_tokens > alone.input_tokens


class Verdict(pydantic.BaseModel):
    ok: bool


def test_output_format_constrains_the_answer(client):
    """Structured outputs as the SDK sends them (`output_format` → output_config.format, a JSON schema): the tiny
    model's answer parses as the schema, created and streamed alike; unconstrained it writes no such JSON."""
    kwargs = dict(model="tgi", messages=[{"role": "user", "content": ASK}], max_tokens=40, extra_body=GREEDY)
    parsed = client.messages.parse(output_format=Verdict, **kwargs)
    assert isinstance(parsed.parsed_output, Verdict) and parsed.stop_reason == "end_turn"
    with client.messages.stream(output_format=Verdict, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == parsed.content[0].text
    plain = client.messages.create(**{**kwargs, "max_tokens": N})
    assert not plain.content[0].text.lstrip().startswith("{")


@pytest.mark.parametrize(
    "body, status, text",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, 422, "grammar"),
        ({"output_config": {"format": {"type": "regex", "schema": {}}}}, 400, "output_config.format.type"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400, "unsupported content block"),
        ({"tools": [{"name": "t"}]}, 400, "input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
        ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}, **EXTRA}, 422, "nope"),
        ({"max_tokens": -1}, 422, "max_tokens"),
        ({"messages": []}, 400, "at least one message"),
    ],
)
def test_bad_input_is_anthropic_error(tiny_server, body, status, text):
    request = {"model": "tgi", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **body}
    r = requests.post(tiny_server.url + "/v1/messages", json=request, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert text in error["error"]["message"]
    ok = requests.post(
        tiny_server.url + "/v1/messages",
        json={"model": "tgi", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"


def test_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tgi", max_tokens=2, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}])
