"""The processor's structured output: grammars compiled in TGI's order with TGI's messages, tools selected before
the chat template renders, TGI's tool prompt appended, --disable-grammar-support and the limits honoured."""

from __future__ import annotations

import pytest

from libs.protocol.messages import RequestError, TokenizedRequest
from libs.runtime.settings import Settings
from services.tokenizer.chat_template import DEFAULT_TOOL_PROMPT
from services.tokenizer.processor import Processor
from tests.services.tokenizer.conftest import LIMITS, request

CHAT = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"enum": [1, 2]}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {"properties": {}}}},
]


@pytest.fixture(scope="module")
def wide(tiny_dir):
    """Room for a chat prompt with tools (the shared processor allows 30 tokens)."""
    return Processor.from_settings(Settings(model_path=str(tiny_dir), max_input_tokens=1000, max_total_tokens=2000))


def error(result) -> tuple[str, str]:
    assert isinstance(result, RequestError), result
    return result.error_type, result.message


@pytest.mark.parametrize(
    "grammar,kind",
    [
        ({"type": "json", "value": {"properties": {"a": {"type": "integer"}}}}, "json"),
        ({"type": "json_object", "value": '{"type": "array"}'}, "json"),
        ({"type": "json_schema", "value": {"name": "x", "schema": {"enum": [1, 2]}}}, "json"),
        ({"type": "regex", "value": "[a-z]+"}, "regex"),
        ('root ::= "yes" | "no"', "gbnf"),
        ({"type": "lark", "value": 'start: "a"+'}, "lark"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}, "json"),
    ],
)
def test_a_grammar_travels_as_its_compiled_text(processor, grammar, kind):
    result = processor.process(request(grammar=grammar))
    assert isinstance(result, TokenizedRequest), result
    assert result.grammar and result.grammar_kind == kind


def test_no_grammar_and_a_text_format_are_unconstrained(processor):
    for grammar in (None, {"type": "text"}):
        result = processor.process(request(grammar=grammar))
        assert isinstance(result, TokenizedRequest) and result.grammar == "" and result.grammar_kind == ""


@pytest.mark.parametrize(
    "grammar,message",
    [
        ({"type": "regex", "value": "("}, "grammar is not valid: "),
        ({"type": "json", "value": "{nope"}, "grammar is not valid: "),
        ({"type": "json", "value": {"type": "nonsense"}}, "grammar is not valid: "),
        ("root ::= undefined_rule", "grammar is not valid: "),
        ({"type": "json", "value": 3}, "grammar is not supported"),
        ({"type": "xml", "value": "a"}, "grammar is not supported"),
    ],
)
def test_bad_grammars_are_422s_with_tgis_messages(processor, grammar, message):
    kind, text = error(processor.process(request(grammar=grammar)))
    assert kind == "validation" and text.startswith("Input validation error: " + message), text


def test_the_grammar_is_checked_after_the_length_checks(processor):
    long = " ".join(["hello"] * 40)
    _, text = error(processor.process(request(long, max_new_tokens=1, grammar={"type": "regex", "value": "("})))
    assert "must be <= 30" in text


def test_disabled_and_limits(tiny_dir):
    wide = dict(max_input_tokens=1000, max_total_tokens=2000)
    disabled = Processor.from_settings(Settings(model_path=str(tiny_dir), disable_grammar_support=True, **wide))
    for grammar in ({"type": "regex", "value": "a+"}, {"type": "json_object"}):
        assert error(disabled.process(request(grammar=grammar))) == (
            "validation",
            "Input validation error: grammar is not supported",
        )
    kind, text = error(disabled.process(request(messages=CHAT, tools=TOOLS, tool_choice="required")))
    assert text == "Input validation error: grammar is not supported"
    small = Processor.from_settings(
        Settings(model_path=str(tiny_dir), grammar_max_bytes=200, grammar_max_depth=4, **LIMITS)
    )
    deep = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "array", "items": {}}}}}
    _, text = error(small.process(request(grammar={"type": "json", "value": deep})))
    assert text.endswith("more than the limit of 4")
    _, text = error(small.process(request(grammar={"type": "regex", "value": "a" * 300})))
    assert text.endswith("bytes, more than the limit of 200")
    slow = Processor.from_settings(Settings(model_path=str(tiny_dir), grammar_compile_timeout_s=1e-9, **LIMITS))
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(200)}}
    _, text = error(slow.process(request(grammar={"type": "json", "value": big})))
    assert text == "Input validation error: grammar is not valid: compiling it took longer than 1e-09 s"


def test_tools_are_selected_and_compiled(wide):
    processor = wide
    result = processor.process(request(messages=CHAT, tools=TOOLS, tool_choice="f"))
    assert isinstance(result, TokenizedRequest) and result.grammar_kind == "tools"
    auto = processor.process(request(messages=CHAT, tools=TOOLS))
    assert isinstance(auto, TokenizedRequest) and auto.grammar_kind == "tools_auto"
    none = processor.process(request(messages=CHAT, tools=TOOLS, tool_choice="none"))
    assert isinstance(none, TokenizedRequest) and none.grammar == ""
    named = {"type": "function", "function": {"name": "g"}}
    assert processor.process(request(messages=CHAT, tools=TOOLS, tool_choice=named)).grammar_kind == "tools"


def test_tool_errors_come_first(processor):
    unknown = request(messages=CHAT, tools=TOOLS, tool_choice="h", temperature=-1.0)
    assert error(processor.process(unknown)) == ("tool_error", "Tool error: Tool with name h not found")
    both = request(messages=CHAT, tools=TOOLS, grammar={"type": "regex", "value": "a"})
    assert error(processor.process(both)) == ("tool_error", "Tool error: Grammar and tools are mutually exclusive")


def test_the_tool_prompt_is_appended_to_the_last_message(processor):
    result = processor.process(request(messages=CHAT, tools=TOOLS, tool_choice="required", mode="tokenize"))
    # the tiny template renders `tools` itself: only the separator and the prompt are appended
    assert "hi\n---\n" + DEFAULT_TOOL_PROMPT in result.text and '"name": "f"' in result.text
    custom = request(messages=CHAT, tools=TOOLS, mode="tokenize")
    custom.tool_prompt = "Call one."
    assert "hi\n---\nCall one." in processor.process(custom).text
    plain = processor.process(request(messages=CHAT, tools=TOOLS, tool_choice="none", mode="tokenize"))
    assert "---" not in plain.text and "Tools:" not in plain.text
