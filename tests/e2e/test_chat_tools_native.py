"""Tool calls in the model's own format, end to end with the openai SDK: a tiny model served with Qwen2.5's
template (tests/data/chat_templates) is forced to call (tool_choice required / named: random weights never call
by themselves); the call comes back parsed, finish_reason `tool_calls`; streamed deltas assemble to the
non-streamed answer; a call → tool result → answer loop; bad input is a 4xx and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import requests
from openai import OpenAI

from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "qwen25.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "native-tools.log"
    with Server(tiny_model_dir, log, "--max-total-tokens", "1024", "--chat-template", str(TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="-")


def _tokenize(server, messages) -> dict:
    return requests.post(server.url + "/chat_tokenize", json={"messages": messages, "tools": TOOLS}, timeout=30).json()


def _call(client, **kw):
    args = dict(model="tgi", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, parallel_tool_calls=False)
    return client.chat.completions.create(**{**args, **kw})


def test_required_call_in_the_models_format(client, server):
    out = _call(client, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "now")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["days"], int)
        # no free whitespace: the template's own separators, nothing else
        assert call.function.arguments == json.dumps(arguments)
    # the prompt the model saw is its own template's, with no TGI tool prompt
    tokenized = _tokenize(server, ASK)
    assert (
        "<tools>" in tokenized["templated_text"] and "Given the functions available" not in tokenized["templated_text"]
    )


def test_named_call_streams_to_the_same_answer(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _call(client, tool_choice=named).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls[0].function.name == "get_weather"
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _call(client, tool_choice=named, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
            assert d.id in (None, entry["id"])
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_call_tool_result_answer_loop(client, server):
    first = _call(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *ASK,
        first.model_dump(exclude_none=False),  # as an agent framework echoes it back (nulls included)
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": '{"temp": 21}'},
    ]
    tokenized = _tokenize(server, messages)["templated_text"]
    assert f'{{"name": "get_weather", "arguments": {call.function.arguments}}}' in tokenized
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in tokenized and "null" not in tokenized
    answer = client.chat.completions.create(
        model="tgi", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


def test_bad_input_is_a_4xx_and_the_server_keeps_serving(client):
    with pytest.raises(openai.UnprocessableEntityError, match="Tool with name nope not found"):
        _call(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    bad = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "now", "arguments": "{x"}}],
        },
    ]
    with pytest.raises(openai.UnprocessableEntityError, match="not valid JSON"):
        _call(client, messages=bad, tool_choice="auto")
    broken = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
        }
    ]
    with pytest.raises(openai.UnprocessableEntityError):
        _call(client, tools=broken, tool_choice="required")
    assert _call(client, tool_choice="required").choices[0].finish_reason == "tool_calls"
