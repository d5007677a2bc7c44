"""services.tokenizer.grammar: every accepted shape compiles to a grammar that accepts what it should and nothing
else; every bad input gets TGI's message (or a clear one of ours where TGI has none)."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from llguidance import LLMatcher

from services.tokenizer.grammar import (
    Grammar,
    GrammarCompiler,
    GrammarLimits,
    ToolError,
    ToolPlan,
    grammar_text,
    tool_grammar,
    tool_schema,
)
from services.tokenizer.validation import ValidationError
from tests.tiny_models import EOS

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name"],
}
SEEDS_GBNF = 'root ::= "{" ws "\\"answer\\"" ws ":" ws [0-9]+ ws "}"\nws ::= [ ]?'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather at a place",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["location"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def compiler(tiny_dir):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS])
    yield c
    c.close()


def accepts(compiler: GrammarCompiler, text: str, output: str) -> bool:
    """Whether the grammar takes `output` whole and is complete after it."""
    m = LLMatcher(compiler.tokenizer, text, log_level=0)
    return m.consume_tokens(compiler.tokenizer.tokenize_str(output)) and m.is_accepting()


def message(exc: pytest.ExceptionInfo) -> str:
    return exc.value.message


# ---- accepted shapes ------------------------------------------------------------------------------------------
SHAPES = [
    ({"type": "json", "value": PERSON}, "json", '{"name": "Ada", "age": 36}'),
    ({"type": "json", "value": json.dumps(PERSON)}, "json", '{"name":"Ada"}'),
    ({"type": "json_object", "value": PERSON}, "json", '{"name": "Ada"}'),
    ({"type": "json_schema", "value": {"name": "person", "schema": PERSON}}, "json", '{"name": "x"}'),
    ({"type": "json_schema", "value": {"schema": PERSON}}, "json", '{"name": "x"}'),
    ({"type": "regex", "value": r"[0-9]{3}-[a-z]+"}, "regex", "123-abc"),
    ({"type": "gbnf", "value": SEEDS_GBNF}, "gbnf", '{ "answer" : 42 }'),
    (SEEDS_GBNF, "gbnf", '{"answer":7}'),
    ({"type": "lark", "value": 'start: "yes" | "no"'}, "lark", "no"),
    ('start: "yes" | "no"', "gbnf", "yes"),  # a bare Lark string works too
    # beyond TGI: schemas without a top-level `properties`
    ({"type": "json", "value": {"type": "array", "items": {"type": "integer"}}}, "json", "[1, 2, 3]"),
    ({"type": "json", "value": {"enum": ["red", "green"]}}, "json", '"green"'),
    ({"type": "json", "value": {"type": "object"}}, "json", '{"anything": [1, {"b": null}]}'),
    # OpenAI's response_format shapes
    ({"type": "json_object"}, "json", '{"k": "v"}'),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}, "json", '{"name":"a"}'),
]


@pytest.mark.parametrize("value,kind,good", SHAPES)
def test_every_shape_compiles_and_accepts_a_matching_output(compiler, value, kind, good):
    checked = compiler.check(value)
    assert checked.kind == kind
    assert checked.compile_s >= 0
    assert accepts(compiler, checked.grammar.text, good)
    assert not accepts(compiler, checked.grammar.text, good + "!")  # nothing may follow a complete answer


@pytest.mark.parametrize("value", [None, {"type": "text"}])
def test_no_constraint(compiler, value):
    assert compiler.check(value) is None


def test_the_grammar_travels_as_msgpack_text_only(compiler):
    checked = compiler.check({"type": "json", "value": PERSON})
    wire = msgspec.msgpack.encode(checked.grammar)
    assert msgspec.msgpack.decode(wire, type=Grammar) == checked.grammar
    assert len(wire) < 1024  # text, not a compiled automaton


def test_extra_keys_are_closed_unless_the_schema_opens_them(compiler):
    closed = compiler.check({"type": "json", "value": PERSON}).grammar.text
    assert not accepts(compiler, closed, '{"name": "a", "extra": 1}')
    opened = compiler.check({"type": "json", "value": {**PERSON, "additionalProperties": True}}).grammar.text
    assert accepts(compiler, opened, '{"name": "a", "extra": 1}')
    nested = {"type": "object", "properties": {"p": PERSON}, "required": ["p"]}
    text = compiler.check({"type": "json", "value": nested}).grammar.text
    assert accepts(compiler, text, '{"p": {"name": "a"}}')
    assert not accepts(compiler, text, '{"p": {"name": "a", "x": 1}}')


def test_json_whitespace_is_bounded(compiler):
    text = compiler.check({"type": "json", "value": PERSON}).grammar.text
    assert accepts(compiler, text, '{\n  "name": "a"\n}')  # pretty printing is fine
    assert not accepts(compiler, text, '{\n\n"name": "a"}')  # a run of newlines is not
    assert not accepts(compiler, text, '{"name":   "a"}')
    assert not accepts(compiler, text, ' {"name": "a"}')


# ---- refusals -------------------------------------------------------------------------------------------------
NOT_SUPPORTED = [
    {"type": "json", "value": 5},
    {"type": "json", "value": [1, 2]},
    {"type": "json"},
    {"type": "yaml", "value": "a: 1"},
    {"value": "x"},
    42,
]


@pytest.mark.parametrize("value", NOT_SUPPORTED)
def test_not_supported(compiler, value):
    with pytest.raises(ValidationError) as e:
        compiler.check(value)
    assert message(e) == "grammar is not supported"
    assert e.value.full_message == "Input validation error: grammar is not supported"


def test_disabled_refuses_every_grammar_with_tgis_message(tiny_dir):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS], disabled=True)
    try:
        for value in ({"type": "regex", "value": "a"}, {"type": "json_object"}, "root ::= [a]"):
            with pytest.raises(ValidationError) as e:
                c.check(value)
            assert message(e) == "grammar is not supported"
        with pytest.raises(ValidationError, match="grammar is not supported"):
            c.check_tools(tool_grammar([WEATHER], "required"))
        assert c.check(None) is None and c.check_tools(tool_grammar(None)) is None
    finally:
        c.close()


INVALID = [
    ({"type": "json", "value": "{not json"}, "Expecting property name"),
    ({"type": "json", "value": {"type": "foo"}}, "foo"),
    ({"type": "json", "value": {"properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
    ({"type": "json", "value": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
    ({"type": "regex", "value": "a(b"}, "unclosed group"),
    ({"type": "regex", "value": 12}, "a regex must be a string"),
    ({"type": "gbnf", "value": "root ::= missing_rule"}, "missing_rule"),
    ({"type": "lark", "value": "start: foo"}, "foo"),
    ({"type": "json_schema", "value": {"name": "x"}}, "`json_schema` needs an object with a `schema`"),
    ({"type": "json_schema", "json_schema": "x"}, "`json_schema` needs an object with a `schema`"),
]


@pytest.mark.parametrize("value,fragment", INVALID)
def test_invalid_grammars(compiler, value, fragment):
    with pytest.raises(ValidationError) as e:
        compiler.check(value)
    assert message(e).startswith("grammar is not valid: ")
    assert fragment in message(e)
    assert "\n" not in message(e)


def test_size_and_depth_limits(tiny_dir, compiler):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS], limits=GrammarLimits(max_bytes=2000, max_depth=8))
    try:
        big = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(200)}}
        with pytest.raises(ValidationError, match=r"grammar is not valid: the schema is \d+ bytes, more than the "):
            c.check({"type": "json", "value": big})
        with pytest.raises(ValidationError, match="the schema is .* more than the limit of 2000"):
            c.check({"type": "json", "value": json.dumps(big)})
        deep: dict = {"type": "integer"}
        for _ in range(5):
            deep = {"type": "object", "properties": {"x": deep}}
        with pytest.raises(ValidationError, match="nests 11 levels deep, more than the limit of 8"):
            c.check({"type": "json", "value": deep})
        with pytest.raises(ValidationError, match="the regex is 3000 bytes, more than the limit of 2000"):
            c.check({"type": "regex", "value": "a" * 3000})
        with pytest.raises(ValidationError, match="grammar is not valid: the schema nests"):
            tool_grammar([{"type": "function", "function": {"name": "f", "parameters": deep}}], limits=c.limits)
        # the same schemas pass under the default limits
        assert compiler.check({"type": "json", "value": big}).kind == "json"
        assert compiler.check({"type": "json", "value": deep}).kind == "json"
    finally:
        c.close()


def test_a_compile_past_its_timeout_is_refused(tiny_dir, monkeypatch):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS], limits=GrammarLimits(compile_timeout_s=0.05))
    try:
        compile_for_real = c._compile

        def slow(text: str) -> str:  # a compile that stalls, as some schemas do (deterministic here)
            time.sleep(0.5)
            return compile_for_real(text)

        monkeypatch.setattr(c, "_compile", slow)
        with pytest.raises(ValidationError, match=r"grammar is not valid: compiling it took longer than 0.05 s"):
            c.check({"type": "regex", "value": "a+"})
        monkeypatch.setattr(c, "_compile", compile_for_real)
        assert c.check({"type": "regex", "value": "a+"}).kind == "regex"  # the compiler still works
    finally:
        c.close()


def test_a_grammar_over_llguidances_limits_is_refused(tiny_dir):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS], limits=GrammarLimits(max_grammar_size=50))
    try:
        schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(40)}}
        with pytest.raises(ValidationError, match="grammar is not valid: "):
            c.check({"type": "json", "value": schema})
    finally:
        c.close()


# ---- tools ----------------------------------------------------------------------------------------------------
def test_tool_schema_is_tgis():
    schema = tool_schema([WEATHER])
    fn = schema["$functions"]["get_weather"]
    assert fn["properties"]["_name"] == {"type": "string", "const": "get_weather"}
    assert fn["required"] == ["_name", "location"]
    assert fn["additionalProperties"] is False
    assert fn["description"] == "Weather at a place"
    assert schema["properties"] == {"function": {"anyOf": [{"$ref": "#/$functions/get_weather"}]}}


@pytest.mark.parametrize(
    "choice,names",
    [
        ("required", ["get_weather", "get_time"]),
        ("get_time", ["get_time"]),
        ({"type": "function", "function": {"name": "get_weather"}}, ["get_weather"]),
    ],
)
def test_tool_choice_forcing_a_call(compiler, choice, names):
    plan = tool_grammar([WEATHER, TIME], choice)
    assert [t["function"]["name"] for t in plan.tools] == names
    checked = compiler.check_tools(plan)
    assert checked.kind == "tools"
    call = {"get_weather": '{"function": {"_name": "get_weather", "location": "Paris"}}'}
    call["get_time"] = '{"function":{"_name":"get_time"}}'
    for name in ("get_weather", "get_time"):
        assert accepts(compiler, checked.grammar.text, call[name]) == (name in names)
    assert not accepts(compiler, checked.grammar.text, "It is sunny.")
    assert not accepts(compiler, checked.grammar.text, '{"function": {"_name": "no_tool", "content": "hi"}}')
    assert not accepts(compiler, checked.grammar.text, '{"function": {"_name": "get_weather"}}')  # required arg


def test_tool_choice_auto_is_a_call_or_plain_text_never_no_tool(compiler):
    plan = tool_grammar([WEATHER, TIME], "auto")
    assert [t["function"]["name"] for t in plan.tools] == ["get_weather", "get_time"]  # no no_tool for the model
    assert tool_grammar([WEATHER], None).kind == "tools_auto"
    text = compiler.check_tools(plan).grammar.text
    for good in ['{"function": {"_name": "get_time"}}', "It is sunny.", "  Sure: {x}", ""]:
        assert accepts(compiler, text, good), good
    for bad in ['{"function": {"_name": "no_tool", "content": "hi"}}', '{"weather": 1}', "  {", "{oops"]:
        assert not accepts(compiler, text, bad), bad


def test_tool_choice_none_and_no_tools_mean_plain_generation():
    plain = ToolPlan(None, None, None, None)
    assert tool_grammar([WEATHER], "none") == plain
    assert tool_grammar(None, "required") == plain
    assert tool_grammar([], "auto") == plain


def test_tool_errors_have_tgis_messages_and_type():
    with pytest.raises(ToolError) as e:
        tool_grammar([WEATHER], "auto", has_grammar=True)
    assert e.value.full_message == "Tool error: Grammar and tools are mutually exclusive"
    assert e.value.error_type == "tool_error"
    with pytest.raises(ToolError) as e:
        tool_grammar([WEATHER], "get_stock_price")
    assert e.value.full_message == "Tool error: Tool with name get_stock_price not found"
    with pytest.raises(ToolError, match="needs a `function` with a `name`"):
        tool_grammar([{"type": "function"}], "auto")


def test_grammar_text_is_pure_and_needs_no_tokenizer():
    kind, text = grammar_text({"type": "regex", "value": "ab+"})
    assert kind == "regex" and LLMatcher.validate_grammar(text) == ""


def test_a_schema_with_properties_is_an_object(compiler):
    text = compiler.check({"type": "json", "value": {"properties": {"a": {"type": "integer"}}}}).grammar.text
    assert accepts(compiler, text, '{"a": 1}')
    for other in ("1.5", '"a"', "[1]", "null"):
        assert not accepts(compiler, text, other)
    text = compiler.check_tools(tool_grammar([WEATHER], "required")).grammar.text
    assert not accepts(compiler, text, "0.5")
