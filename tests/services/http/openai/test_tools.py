"""Reading tool calls out of the generated text: the tool modes, whole calls, and calls streamed as deltas."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from services.http.errors import Failure
from services.http.openai import tools as ot

MESSAGES = [{"role": "user", "content": "hi"}]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}},
                "required": ["location"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "arguments": {"type": "object"}}},
]


def test_tool_modes():
    # the tokenizer selects the tools and compiles their grammar; http only reads the answer back
    assert ot.tool_mode(TOOLS, None) == ot.tool_mode(TOOLS, "auto") == "auto"
    assert ot.tool_mode(TOOLS, "required") == ot.tool_mode(TOOLS, "noop") == "call"
    assert ot.tool_mode(TOOLS, {"type": "function", "function": {"name": "noop"}}) == "call"
    assert ot.tool_mode(TOOLS, "none") is None and ot.tool_mode(None, "auto") is None and ot.tool_mode([], None) is None
    assert ot.next_call_id(MESSAGES) == "0"
    earlier = [{"role": "assistant", "tool_calls": [{"id": "4"}, {"id": "11"}]}, *MESSAGES]
    assert ot.next_call_id(earlier) == "12"
    assert len(ot.next_call_id([{"role": "assistant", "tool_calls": [{"id": "call_x"}]}])) == 36  # a UUID


def test_parse_tool_call():
    calls = ot.parse_tool_call('{"function": {"_name": "get_weather", "location": "Paris"}}')
    assert msgspec.to_builtins(calls) == [
        {
            "id": "0",
            "type": "function",
            "function": {"description": None, "name": "get_weather", "arguments": '{ "location": "Paris"}'},
        }
    ]
    calls = ot.parse_tool_call('{"function":{"_name":"noop"}}', "3")
    assert (calls[0].id, calls[0].function.arguments) == ("3", "{}")
    assert ot.is_call(' \n{"function"') and not ot.is_call(" plain {")
    for bad in ("not json", '{"x": 1}', '{"function": {"location": 1}}'):
        with pytest.raises(Failure) as e:
            ot.parse_tool_call(bad)
        assert e.value.error_type == "tool_error"


def stream(pieces: list[str], auto: bool) -> list[tuple]:
    s = ot.ToolStream(auto)
    return [d for i, p in enumerate(pieces) for d in s.push(p, i == len(pieces) - 1)]


@pytest.mark.parametrize(
    "text",
    [
        '{"function": {"_name": "get_weather", "location": "Paris", "n": {"a": [1, 2]}}}',
        '{"function":{"_name":"noop"}}',
        ' {\n  "function": {\n    "_name": "get_weather",\n    "location": "}}"\n  }\n}',
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_streamed_tool_call_pieces_add_up_to_the_answer(text, size):
    pieces = [text[i : i + size] for i in range(0, len(text), size)] + [""]  # the last: EOS, no text
    for auto in (False, True):
        deltas = stream(pieces, auto)
        assert all(d[0] == "call" for d in deltas)
        (call,) = ot.parse_tool_call(text)
        assert deltas[0][1] == call.function.name and all(d[1] is None for d in deltas[1:])
        assert "".join(d[2] for d in deltas) == call.function.arguments
        orjson.loads(call.function.arguments)


def test_auto_streams_content_that_does_not_start_a_call():
    deltas = stream([" ", "\n", "Hi", " {there}", ""], auto=True)
    assert [d[0] for d in deltas] == ["content"] * 3 and "".join(d[1] for d in deltas) == " \nHi {there}"
    assert stream([" ", ""], auto=True) == [("content", " ")]  # blanks only: still content, and a last chunk
    with pytest.raises(Failure) as e:
        stream(['{"function": {"_na'], auto=False)  # cut by max_tokens
    assert e.value.error_type == "tool_error"
