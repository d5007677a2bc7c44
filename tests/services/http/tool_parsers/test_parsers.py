"""The tool-call parsers on recorded outputs of each format, malformed ones included; streamed character by
character (and token-sized) their deltas assemble to exactly the whole answer's parse; the chooser."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.http.tool_parsers import PARSERS, ToolCallStream, choose, native_parser

TEMPLATES = Path(__file__).parents[3] / "data" / "chat_templates"

# (format, recorded output, expected content, expected calls)
RECORDED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Let me check.\n\n",
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
    ),
    ("hermes", "no call <tool here", "no call <tool here", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    # cut by max_tokens inside the arguments: the call as far as it went
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "b', None, [("f", '{"a": "b')]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"a": 1}'), ("g", "{}")],
    ),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}', None, [("f", '{"a": [1, 2]}')]),
    ("llama3_json", "Hello {x}", "Hello {x}", []),
    ("llama3_json", "  {oops", "  {oops", []),
    (
        "mistral",
        'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": [1]}}]',
        "Sure ",
        [("f", '{"a": 1}'), ("g", '{"b": [1]}')],
    ),
    ("mistral", '[{"name": "f", "arguments": {}}]', None, [("f", "{}")]),  # the special token left the text
    ("mistral", "x [TOOL_CALLS] nope", "x [TOOL_CALLS] nope", []),
    (
        "pythonic",
        '[get_weather(city="Paris", days=3), now()]',
        None,
        [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}")],
    ),
    ("pythonic", '[f(a=true, b=null, c={"k": [1]})]', None, [("f", '{"a": true, "b": null, "c": {"k": [1]}}')]),
    ("pythonic", "<|python_start|>[f(a=1)]<|python_end|>", None, [("f", '{"a": 1}')]),
    ("pythonic", "[broken(", "[broken(", []),
    ("pythonic", "Hello", "Hello", []),
]


def _assemble(parser, text: str, step: int):
    stream = ToolCallStream(parser)
    deltas = []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        deltas += stream.push(piece, i == len(pieces) - 1)
    content = "".join(d.content for d in deltas if d.call is None)
    calls: dict[int, list] = {}
    for d in deltas:
        if d.call is None:
            continue
        if d.call not in calls:
            assert d.name is not None and d.id is not None  # a call's first delta names it, with its id
            calls[d.call] = [d.name, "", d.id]
        else:
            assert d.name is None and d.id is None
        calls[d.call][1] += d.arguments
    assert [c.id for c in stream.finished] == [calls[i][2] for i in sorted(calls)]  # ids stable to the end
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_recorded_outputs(name, text, content, calls):
    parser = PARSERS[name]()
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for step in (1, 3, 7):
        streamed_content, streamed_calls = _assemble(parser, text, step)
        assert streamed_calls == calls
        assert streamed_content == (content or "") or (content is None and not streamed_content.strip())


def test_chooser_reads_the_template():
    assert choose((TEMPLATES / "qwen25.jinja").read_text()).name == "hermes"
    assert choose((TEMPLATES / "llama31.jinja").read_text()).name == "llama3_json"
    assert choose((TEMPLATES / "mistral.jinja").read_text()).name == "mistral"
    assert choose("{{ messages }}") is None
    assert choose("<tool_call>", "pythonic").name == "pythonic"  # the flag wins
    qwen = (TEMPLATES / "qwen25.jinja").read_text()
    assert native_parser(qwen, True).name == "hermes"
    assert native_parser(qwen, True, tool_prompt="Use a tool") is None  # TGI's way, asked for
    assert native_parser(qwen, True, flag="tgi") is None
    assert native_parser(qwen, False) is None  # a template that renders no tools
