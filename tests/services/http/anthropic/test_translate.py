"""Messages requests → the chat body: blocks become the chat messages a template reads; x-api-key opens the
routes behind --api-key."""

from __future__ import annotations

import msgspec
import pytest

from services.http.anthropic import translate
from services.http.anthropic.schemas import MessagesRequest
from services.http.errors import Failure
from tests.services.http.fakes import FakeIngress, client, run


def body(**fields) -> MessagesRequest:
    return msgspec.convert({"model": "m", "max_tokens": 4, **fields}, MessagesRequest)


def test_blocks_become_chat_messages():
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "Oslo it is", "signature": "x"},
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]
    tools = [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}]
    chat = translate.chat_body(
        body(system=[{"type": "text", "text": "sys"}], messages=messages, tools=tools, top_k=3, stop_sequences=["\n"],
             tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking={"type": "disabled"})
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
            # the thinking blocks, for the template (a redacted one cannot be read)
            "reasoning_content": "hmm\nOslo it is",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny", "name": "get_weather"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "description": "d"}}
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["top_k"] == 3 and chat["stop"] == ["\n"] and chat["max_tokens"] == 4
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_effort_is_the_chat_reasoning_effort():
    from services.http.openai import requests as oa

    ask = [{"role": "user", "content": "q"}]
    chat = translate.chat_body(body(messages=ask, output_config={"effort": "max"}))
    assert chat["reasoning_effort"] == "high"
    request = msgspec.convert(chat, oa.ChatRequest)
    assert oa.template_kwargs(request) == {"reasoning_effort": "high"} and oa.thinking_budget(request) == 16384
    assert "reasoning_effort" not in translate.chat_body(body(messages=ask, output_config={"format": None}))
    with pytest.raises(Failure, match="output_config.effort"):
        translate.chat_body(body(messages=ask, output_config={"effort": "huge"}))


def test_output_format_is_the_chat_response_format():
    from services.http.openai import requests as oa

    ask = [{"role": "user", "content": "q"}]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = translate.chat_body(body(messages=ask, output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    # the grammar /v1/chat/completions sends for the same response_format, which the tokenizer compiles
    parameters = oa.chat_parameters(msgspec.convert(chat, oa.ChatRequest), "m")
    assert parameters.grammar == chat["response_format"]
    for fmt, where in (
        ({"type": "text"}, "format.type"),
        ({"type": "json_schema"}, "format.schema"),
        ("x", "format.type"),
    ):
        with pytest.raises(Failure, match=f"output_config.{where}") as e:
            translate.chat_body(body(messages=ask, output_config={"format": fmt}))
        assert e.value.status == 400


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choice(choice, expected):
    assert translate.chat_tool_choice(choice) == expected


def test_refusals():
    with pytest.raises(Failure, match="unsupported tool type"):
        translate.chat_body(
            body(
                messages=[{"role": "user", "content": "x"}],
                tools=[{"name": "bash", "type": "bash_20250124", "input_schema": {}}],
            )
        )
    with pytest.raises(Failure, match="tool_use block needs an id"):
        translate.chat_body(body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]))


def test_x_api_key_opens_the_protected_routes():
    async def scenario():
        async with client(FakeIngress(), api_key="s3cret-Key") as c:
            out = []
            for headers in (
                {},
                {"x-api-key": "s3cret-Key"},
                {"x-api-key": "other"},
                {"Authorization": "Bearer s3cret-Key"},
            ):
                for path in ("/v1/messages/count_tokens", "/v1/responses/resp_x"):
                    method = "POST" if path.endswith("count_tokens") else "GET"
                    body = {"model": "tgi", "messages": [{"role": "user", "content": "a b c"}]}
                    r = await c.request(method, path, json=body, headers=headers)
                    out.append(r.status)
            return out

    # count_tokens answers (the fake renders no template: the messages' text, one token per word); an unknown
    # stored response is a 404
    assert run(scenario()) == [401, 401, 200, 404, 401, 401, 200, 404]
