"""The Responses and Messages APIs on a tiny model served with Qwen2.5's template (tests/data/chat_templates): the
tools reach the model in its own format (no TGI tool prompt), a forced call is read back from its `<tool_call>`
syntax, streamed as it is returned whole, and a call → result → answer loop runs through each API's SDK."""

from __future__ import annotations

import json

import anthropic
import pytest
from openai import OpenAI

from tests.e2e.test_chat_tools_native import TOOLS, server  # noqa: F401 (the module's server fixture)

pytestmark = pytest.mark.e2e

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
A_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"temperature": 0}


def check_arguments(name: str, arguments: dict) -> None:
    assert name in ("get_weather", "now")
    if name == "get_weather":
        assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["days"], int)


def test_responses_native_call_stream_and_loop(server):  # noqa: F811
    client = OpenAI(base_url=server.url + "/v1", api_key="-")
    kwargs = dict(model="tgi", input="Weather in Paris?", tools=FLAT, parallel_tool_calls=False, max_output_tokens=120)
    first = client.responses.create(**kwargs, tool_choice="required", temperature=0)
    (call,) = [i for i in first.output if i.type == "function_call"]
    check_arguments(call.name, json.loads(call.arguments))
    assert first.status == "completed"
    with client.responses.stream(**kwargs, tool_choice="required", temperature=0) as stream:
        list(stream)
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [(call.name, call.arguments)]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    second = client.responses.create(
        model="tgi", previous_response_id=first.id, input=[output], tools=FLAT, tool_choice="none",
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert second.output[-1].type == "message" and second.usage.input_tokens > first.usage.input_tokens


def test_messages_native_call_stream_and_loop(server):  # noqa: F811
    client = anthropic.Anthropic(base_url=server.url, api_key="-")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model="tgi", messages=ask, tools=A_TOOLS, max_tokens=120, extra_body=GREEDY)
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = client.messages.create(**kwargs, tool_choice=choice)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and first.stop_reason == "tool_use"
    check_arguments(use.name, use.input)
    with client.messages.stream(**kwargs, tool_choice=choice) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"sky": "clear"}'}
    conversation = [*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(
        model="tgi", messages=conversation, tools=A_TOOLS, tool_choice={"type": "none"}, max_tokens=8, extra_body=GREEDY
    )
    assert second.content[-1].type == "text" and second.stop_reason in ("max_tokens", "end_turn")
    counted = client.messages.count_tokens(
        model="tgi", messages=conversation, tools=A_TOOLS, tool_choice={"type": "none"}
    )
    assert counted.input_tokens == second.usage.input_tokens
