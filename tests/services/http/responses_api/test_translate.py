"""Responses requests → the chat body: an agent's items become the chat messages a template reads."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.http.errors import OpenAIFailure
from services.http.responses_api import translate
from services.http.responses_api.schemas import (
    FunctionCall,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseOutputMessage,
    ResponsesRequest,
)
from services.tokenizer.chat_template import ChatTemplates

TEMPLATES = Path(__file__).parents[3] / "data" / "chat_templates"


def body(**fields) -> ResponsesRequest:
    return msgspec.convert(fields, ResponsesRequest)


def test_agent_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text", "text": "Oslo"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    tools = [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}}]
    chat = translate.chat_body(
        body(input=items, instructions="sys", tools=tools, tool_choice={"type": "function", "name": "get_weather"},
             max_output_tokens=5, text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}),
        [],
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "description": "d"}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_tokens"] == 5
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": None},
    }


def test_reasoning_items_go_to_the_next_assistant_turn():
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t1"}]}
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s2"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    messages = translate.input_messages(
        [
            {"role": "user", "content": "q"},
            thought,
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            summary,
            {"role": "assistant", "content": "done"},
            {"type": "reasoning", "encrypted_content": "opaque", "summary": []},  # nothing readable: none
            {"role": "assistant", "content": "more"},
            thought,  # before a user turn: no assistant turn of its own
            {"role": "user", "content": "again"},
        ]
    )
    assert [m.get("reasoning_content") for m in messages] == [None, "t1", None, "s2", None, None]
    # the items of a stored response carry their reasoning into the next request's prompt as well
    output = [ReasoningItem("rs_2", content=[ReasoningText("t3")]), FunctionCall("fc_1", "c2", "f", "{}")]
    assert translate.output_messages(output)[0]["reasoning_content"] == "t3"


def test_reasoning_effort_is_a_template_variable():
    from services.http.openai import requests as oa

    chat = translate.chat_body(body(input="q", reasoning={"effort": "low"}), [])
    assert chat["reasoning_effort"] == "low"
    request = msgspec.convert(chat, oa.ChatRequest)
    assert oa.template_kwargs(request) == {"reasoning_effort": "low"} and oa.thinking_budget(request) == 1024
    chat["chat_template_kwargs"] = {"reasoning_effort": "high", "x": 1}  # an explicit value wins
    assert oa.template_kwargs(msgspec.convert(chat, oa.ChatRequest)) == {"reasoning_effort": "high", "x": 1}


def test_output_continues_the_conversation():
    output = [
        ResponseOutputMessage("msg_1", [OutputText("let me check")]),
        FunctionCall("fc_1", "call_1", "get_weather", '{"city":"Oslo"}'),
    ]
    # the turn's text and its call are one assistant turn, as chat completions has it
    assert translate.output_messages(output) == [
        {
            "role": "assistant",
            "content": "let me check",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
    ]


def test_a_replayed_turn_renders_as_its_chat_completions_form():
    """An assistant message and its function_call items, as a client replays a turn, give the prompt of the same
    conversation in chat completions' form: one assistant turn with content and tool_calls (Qwen2.5's template)."""
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    items = [
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me check"}]},
        {"type": "function_call", "call_id": "call_1", **call},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    chat = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": "let me check",
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    templates = ChatTemplates({"default": (TEMPLATES / "qwen25.jinja").read_text()})
    prompt = templates.render(translate.input_messages(items), tools, native=True)
    assert prompt == templates.render(chat, tools, native=True)
    assert prompt.count("<|im_start|>assistant") == 2  # the replayed turn, and the generation prompt's


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": []}, "input"),
    ],
)
def test_refusals_name_the_param(fields, param):
    with pytest.raises(OpenAIFailure) as e:
        translate.chat_body(body(**fields), [])
    assert e.value.status == 400 and e.value.param == param and e.value.kind == "invalid_request_error"
