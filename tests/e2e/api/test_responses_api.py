"""OpenAI's Responses API through the openai SDK, unmodified, on the tiny model: responses.create and
responses.stream against transformers' greedy output on the same chat template, tools forced (required, named),
text.format json_schema, previous_response_id through the store, a short agent loop (call → output → answer),
and bad input answered in OpenAI's error shape while the server keeps serving."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from openai import OpenAI

from tests.e2e.test_structured_output import TOOL_PARAMS, TOOL_PROMPT, TOOLS
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

N = 8
INSTRUCTIONS = "you hum old songs"
ASK = "the quick brown fox"
# TGI's tool prompt, short: the tiny server's prompts are limited to 400 tokens
EXTRA = {"tool_prompt": TOOL_PROMPT}
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tiny_server):
    return OpenAI(base_url=tiny_server.url + "/v1", api_key="-")


def greedy_text(model_dir, tokenizer, messages: list[dict], n: int = N) -> str:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = reference_generate(model_dir, tokenizer(rendered, add_special_tokens=False).input_ids, n)
    return tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")


def test_create_and_stream_equal_transformers(client, tiny_model_dir, tiny_tokenizer):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}]
    expected = greedy_text(tiny_model_dir, tiny_tokenizer, messages)
    r = client.responses.create(model="tgi", instructions=INSTRUCTIONS, input=ASK, max_output_tokens=N, temperature=0)
    assert r.output_text == expected
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == N and r.usage.total_tokens == r.usage.input_tokens + N
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_")

    # items as input (a message item with parts) give the same prompt
    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]
    events = list(client.responses.create(model="tgi", input=items, max_output_tokens=N, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output[0].content[0].text == expected


def test_stream_helper_with_json_schema(client):
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    with client.responses.stream(model="tgi", input=ASK, text=fmt, max_output_tokens=80, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    assert "".join(deltas) == final.output_text
    whole = client.responses.create(model="tgi", input=ASK, text=fmt, max_output_tokens=80, temperature=0)
    assert whole.output_text == final.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_call_create_and_stream(client, choice):
    kwargs = dict(
        model="tgi",
        input="the weather please",
        tools=FLAT_TOOLS,
        tool_choice=choice,
        max_output_tokens=80,
        extra_body=EXTRA,
    )
    r = client.responses.create(**kwargs, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name in TOOL_PARAMS and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOL_PARAMS[call.name])
    if choice != "required":
        assert call.name == "get_weather"
    with client.responses.stream(**kwargs, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(call.name, call.arguments)]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments


def test_agent_loop_through_previous_response_id(client, tiny_server):
    """call → the tool's output → an answer; the second request continues the first by its id (the store)."""
    first = client.responses.create(
        model="tgi",
        input="the weather please",
        tools=FLAT_TOOLS,
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
        extra_body=EXTRA,
    )
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    second = client.responses.create(
        model="tgi",
        previous_response_id=first.id,
        input=[output],
        tools=FLAT_TOOLS,
        tool_choice="none",
        max_output_tokens=N,
        temperature=0,
        extra_body=EXTRA,
    )
    assert second.output[0].type == "message" and second.previous_response_id == first.id
    # the same conversation sent whole, without the store, is the same prompt: the same greedy answer
    whole = [
        {"role": "user", "content": "the weather please"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        output,
    ]
    again = client.responses.create(
        model="tgi",
        input=whole,
        tools=FLAT_TOOLS,
        tool_choice="none",
        max_output_tokens=N,
        temperature=0,
        store=False,
        extra_body=EXTRA,
    )
    assert again.output_text == second.output_text
    assert again.usage.input_tokens == second.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # store=False: not kept
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tgi", previous_response_id=second.id, input="more", max_output_tokens=2)


@pytest.mark.parametrize(
    "body, status, text",
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "Unsupported tool type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "Unsupported input item type"),
        ({"input": "x", "tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "schema"),
        (
            {"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}, **EXTRA},
            422,
            "nope",
        ),
        ({"input": 3}, 422, "input"),
        ({"input": "x", "previous_response_id": "resp_missing"}, 404, "not found"),
    ],
)
def test_bad_input_is_openai_error(tiny_server, body, status, text):
    r = requests.post(
        tiny_server.url + "/v1/responses", json={"model": "tgi", "max_output_tokens": 2, **body}, timeout=60
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and text in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = requests.post(tiny_server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["status"] == "incomplete"
