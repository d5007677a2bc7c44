"""Structured output at the tokenizer: every accepted request shape → one llguidance grammar, checked and compiled.

Only the grammar *text* travels on (tokenizer → admit → scheduler → shard); every process that needs a matcher
compiles it again against the same tokenizer.json. `grammar_text` reads TGI's `parameters.grammar` (`json`,
`json_object`, `regex`, `json_schema`), `gbnf` / `lark` and bare strings beyond TGI, and OpenAI's `response_format`
(`json_object`, `json_schema`, `text`: no constraint); `tool_grammar` turns `tools` + `tool_choice` into one
grammar; `GrammarCompiler` compiles against the served vocabulary, with limits and a timeout. JSON grammars bound
their whitespace, so a random model cannot loop on blanks, and a schema with `properties` is read as outlines (TGI's
compiler) reads it: an object, with no keys beyond those listed unless it says otherwise (TGI's own tool schema has
no `"type": "object"`). docs/structured-output.md tells the shapes in full, and why llguidance.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from services.tokenizer.validation import ValidationError

# Between two JSON tokens: nothing, one space, or one newline and an indent (pretty printing up to depth 8).
JSON_WHITESPACE = r"(?:[ ]|\n[ \t]{0,16})?"
# A plain answer under tool_choice=auto: anything whose first non-blank character is not `{` (that one starts a
# tool call), so the two alternatives part at the first visible character and the client never sees `no_tool`.
TOOL_OR_TEXT_CONTENT = r"/[ \t\r\n]*([^{ \t\r\n][\s\S]*)?/"
# JSON Schema keywords whose value is one subschema, a list of them, or a name → subschema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "$functions")
_TYPED_KEYS = ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref")


class Grammar(msgspec.Struct, frozen=True, array_like=True):
    """What travels on the bus: llguidance's grammar text (its JSON or Lark form); a matcher compiles it."""

    text: str


class Checked(NamedTuple):
    """The tokenizer's result for one request: the grammar to forward and what its check measured."""

    grammar: Grammar
    kind: str  # json | regex | gbnf | lark | tools | tools_auto (a metrics label)
    compile_s: float


class ToolPlan(NamedTuple):
    """tools + tool_choice resolved: what the chat template sees and the grammar that forces the answer."""

    tools: list[dict] | None  # for the template (None: no tools, plain generation)
    kind: str | None  # "tools" (a call is required) | "tools_auto" (a call or plain text) | None
    text: str | None  # llguidance grammar text
    lark: str | None = None  # the model's own call format: its Lark rules (services.tokenizer.answer_grammar)


class ToolError(ValidationError):
    """TGI's InferError::ToolError: 422 `Tool error: …`, error_type tool_error."""

    error_type = "tool_error"

    @property
    def full_message(self) -> str:
        return "Tool error: " + self.message


class GrammarLimits(NamedTuple):
    max_bytes: int = 256 * 1024  # the grammar or schema as text
    max_depth: int = 64  # JSON nesting of a schema (objects and arrays)
    compile_timeout_s: float = 5.0  # wall clock for one compile against the tokenizer
    max_grammar_size: int = 200_000  # llguidance: symbols in the grammar's productions
    max_lexer_states: int = 100_000  # llguidance: lexer states (~1-2 kB each)


def not_valid(reason: str) -> ValidationError:
    return ValidationError(f"grammar is not valid: {reason}")


def _depth(value: Any) -> int:
    """JSON nesting depth without recursion (a hostile schema must not blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _closed(schema: Any) -> Any:
    """A copy of `schema` read as outlines (TGI's compiler) reads it: a schema that lists `properties` is an
    object, and allows no other keys unless it says so. allOf branches are left open: each lists only part of
    the keys."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _TYPED_KEYS):
        out["type"] = "object"  # outlines (and TGI's tool schema) read `properties` as "an object"
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    return out


def _schema(value: Any, limits: GrammarLimits) -> dict:
    """A JSON schema given as an object or a JSON string, parsed and bounded."""
    if isinstance(value, str):
        if len(value.encode()) > limits.max_bytes:
            raise not_valid(f"the schema is {len(value.encode())} bytes, more than the limit of {limits.max_bytes}")
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise not_valid(str(e)) from None
    elif not isinstance(value, dict | bool):
        raise ValidationError("grammar is not supported")  # TGI: a json value neither object nor string
    if isinstance(value, bool):  # `true` / `false` are schemas too; llguidance wants an object
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise not_valid(f"a JSON schema must be an object, got {type(value).__name__}")
    depth = _depth(value)
    if depth > limits.max_depth:
        raise not_valid(f"the schema nests {depth} levels deep, more than the limit of {limits.max_depth}")
    size = len(json.dumps(value))
    if size > limits.max_bytes:
        raise not_valid(f"the schema is {size} bytes, more than the limit of {limits.max_bytes}")
    return value


def json_grammar(schema: dict) -> str:
    """llguidance's grammar for a schema, extra keys closed, whitespace bounded."""
    return LLMatcher.grammar_from_json_schema(_closed(schema), overrides={"whitespace_pattern": JSON_WHITESPACE})


def _text_value(value: Any, what: str, limits: GrammarLimits) -> str:
    if not isinstance(value, str):
        raise not_valid(f"a {what} must be a string")
    if len(value.encode()) > limits.max_bytes:
        raise not_valid(f"the {what} is {len(value.encode())} bytes, more than the limit of {limits.max_bytes}")
    return value


def _gbnf(value: str) -> str:
    """GBNF (llama.cpp) or Lark text → llguidance's grammar (any_to_lark passes Lark through)."""
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as e:  # the converter raises its own errors, all of them "this is not a grammar"
        raise not_valid(str(e)) from None


def grammar_text(value: Any, limits: GrammarLimits = GrammarLimits()) -> tuple[str, str] | None:
    """(kind, llguidance grammar text) for `parameters.grammar` or `response_format`; None = no constraint.

    Raises ValidationError with TGI's messages: "grammar is not supported" for a json value that is neither an
    object nor a string or an unknown type, "grammar is not valid: …" for the rest.
    """
    if value is None:
        return None
    if isinstance(value, str):  # beyond TGI: a bare grammar string (the seeds send `root ::= …`)
        return "gbnf", _gbnf(_text_value(value, "grammar", limits))
    if not isinstance(value, dict):
        raise ValidationError("grammar is not supported")
    kind = value.get("type")
    if kind in ("json", "json_object"):
        if "value" not in value and kind == "json_object":  # OpenAI: any JSON object
            return "json", json_grammar({"type": "object"})
        return "json", json_grammar(_schema(value.get("value"), limits))
    if kind == "json_schema":
        # TGI puts {"name"?, "schema"} under "value"; OpenAI under "json_schema" (with "strict", which llguidance
        # honours anyway: the output always follows the schema)
        inner = value.get("value") if "value" in value else value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise not_valid("`json_schema` needs an object with a `schema`")
        return "json", json_grammar(_schema(inner["schema"], limits))
    if kind == "regex":
        return "regex", LLMatcher.grammar_from_regex(_text_value(value.get("value"), "regex", limits))
    if kind == "gbnf":
        return "gbnf", _gbnf(_text_value(value.get("value"), "GBNF grammar", limits))
    if kind == "lark":
        return "lark", LLMatcher.grammar_from_lark(_text_value(value.get("value"), "Lark grammar", limits))
    if kind == "text":  # OpenAI: plain text, no constraint
        return None
    raise ValidationError("grammar is not supported")


def _choice_name(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict):  # {"type":"function","function":{"name":…}}
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice must name a function")
        return name
    if tool_choice is None:
        return "auto"
    if not isinstance(tool_choice, str):
        raise ToolError("tool_choice must be auto, none, required, a function name or a function object")
    return tool_choice


def _function(tool: Any) -> dict:
    """A tool's `function` object (http checks the shape already; this keeps the module safe on its own)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError("every tool needs a `function` with a `name`")
    return fn


def tool_schema(tools: list[dict]) -> dict:
    """TGI's tool grammar (ToolGrammar::apply): one `$functions` entry per tool, `function` any of them."""
    functions = {}
    for tool in tools:
        fn = _function(tool)
        params = fn.get("arguments") or fn.get("parameters") or {}
        params = params if isinstance(params, dict) else {}
        functions[fn["name"]] = {
            "description": fn.get("description"),
            "properties": {"_name": {"type": "string", "const": fn["name"]}, **(params.get("properties") or {})},
            "required": ["_name", *(params.get("required") or [])],
            "additionalProperties": params.get("additionalProperties", False),
        }
    return {
        "$functions": functions,
        "properties": {"function": {"anyOf": [{"$ref": f"#/$functions/{name}"} for name in functions]}},
        "required": ["function"],
    }


def tool_grammar(
    tools: list[dict] | None,
    tool_choice: Any = None,
    *,
    has_grammar: bool = False,
    limits: GrammarLimits = GrammarLimits(),
) -> ToolPlan:
    """TGI's tool selection and grammar, with one change under `auto` (docs/structured-output.md).

    TGI adds a synthetic `no_tool` function under auto and, when the model picks it, runs generation again without
    tools (twice the latency). Here the grammar is "a tool call, or plain text that does not start with `{`": one
    pass, and the answer is a tool call exactly when its first non-blank character is `{`.
    """
    if tools is not None and has_grammar:
        raise ToolError("Grammar and tools are mutually exclusive")
    if not tools:
        return ToolPlan(None, None, None)
    choice = _choice_name(tool_choice)
    if choice == "none":
        return ToolPlan(None, None, None)
    if choice in ("auto", "required"):
        chosen = list(tools)
    else:
        chosen = [t for t in tools if _function(t)["name"] == choice]
        if not chosen:
            raise ToolError(f"Tool with name {choice} not found")
    schema = _schema(tool_schema(chosen), limits)  # the size and depth limits hold for tools too
    if choice != "auto":
        return ToolPlan(chosen, "tools", json_grammar(schema))
    call = json.dumps(_closed(schema) | {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})
    lark = f"start: tool_call | content\ntool_call: %json {call}\ncontent: {TOOL_OR_TEXT_CONTENT}\n"
    return ToolPlan(chosen, "tools_auto", LLMatcher.grammar_from_lark(lark))


WAIT_SLICE_S = 0.25  # how often a wait for a compile hands back to the service (on_wait)


class GrammarCompiler:
    """Compiles grammars against the served tokenizer, with limits and a wall-clock timeout per request.

    The LLTokenizer is built on a thread at start (seconds for a large vocabulary, during which llguidance holds the
    GIL); the first grammar request waits for it. Compiles run on a small pool: llguidance releases
    the GIL while it builds a matcher, so the service loop keeps answering other requests meanwhile. A compile
    that times out keeps its worker until llguidance's own fuel limits stop it; the request gets its 422 at once.
    A text that compiled is remembered (LRU): the next request with it skips the compile (its compile_s, the
    metric's sample, is then the lookup's ~0).
    """

    def __init__(
        self,
        tokenizer_json: str,
        eos_ids: list[int],
        *,
        limits: GrammarLimits = GrammarLimits(),
        disabled: bool = False,
        workers: int = 2,
        cache_size: int = 256,
    ) -> None:
        self.limits = limits
        self.disabled = disabled
        # grammar texts that compiled already: the same text against the same tokenizer and limits always does,
        # so a schema many requests share (a client's tool list) is compiled once
        self._valid: OrderedDict[str, None] = OrderedDict()
        self._cache_size = cache_size
        self.compiled = self.reused = 0
        # called every WAIT_SLICE_S while the service waits for a compile: the tokenizer service beats its heartbeat
        # there, so a compile near the 5 s timeout never makes it look gone (stale after 3 s without one)
        self.on_wait: Callable[[], None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        # no slices: they speed up masks (the shard's work); a compile is as fast without, and the build quicker
        self._tokenizer = self._pool.submit(LLTokenizer, tokenizer_json, eos_token=list(eos_ids), slices=[])
        self._parser_limits = LLParserLimits(
            max_grammar_size=limits.max_grammar_size, max_lexer_states=limits.max_lexer_states, verbose_errors=False
        )

    @property
    def tokenizer(self) -> LLTokenizer:
        return self._tokenizer.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _wait(self, future: concurrent.futures.Future, deadline: float | None = None):
        """The future's result, calling on_wait every WAIT_SLICE_S meanwhile; TimeoutError once past `deadline`
        (a time.perf_counter() value; None: no limit)."""
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.perf_counter())
            try:
                return future.result(timeout=max(0.0, left))
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.perf_counter() >= deadline:
                    raise
                if self.on_wait is not None:
                    self.on_wait()

    def _compile(self, text: str) -> str:
        matcher = LLMatcher(self.tokenizer, text, log_level=0, limits=self._parser_limits)
        return matcher.get_error() if matcher.is_error() else ""

    def compile(self, kind: str, text: str) -> Checked:
        """Compile `text` for the served vocabulary; ValidationError on any failure (the grammar never reaches a
        batch)."""
        if self.disabled:
            raise ValidationError("grammar is not supported")
        self._wait(self._tokenizer)  # its load (once, seconds) does not count against the request's timeout
        t0 = time.perf_counter()
        if text in self._valid:
            self._valid.move_to_end(text)
            self.reused += 1
            return Checked(Grammar(text), kind, time.perf_counter() - t0)
        future = self._pool.submit(self._compile, text)
        try:
            error = self._wait(future, t0 + self.limits.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise not_valid(f"compiling it took longer than {self.limits.compile_timeout_s:g} s") from None
        if error:
            raise not_valid(_one_line(error))
        self.compiled += 1
        self._valid[text] = None
        if len(self._valid) > self._cache_size:
            self._valid.popitem(last=False)
        return Checked(Grammar(text), kind, time.perf_counter() - t0)

    def check(self, value: Any) -> Checked | None:
        """`parameters.grammar` (or a chat request's response_format) → its compiled check, None if unconstrained.
        The "not supported" refusal comes first, as TGI's --disable-grammar-support does."""
        if value is None:
            return None
        if self.disabled:
            raise ValidationError("grammar is not supported")
        shaped = grammar_text(value, self.limits)
        return None if shaped is None else self.compile(*shaped)

    def check_tools(self, plan: ToolPlan) -> Checked | None:
        return None if plan.text is None else self.compile(plan.kind, plan.text)


def _one_line(error: str, limit: int = 400) -> str:
    """llguidance's error on one line and bounded (it quotes the grammar, which the client sent and may be long)."""
    text = " ".join(line.strip() for line in error.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 1] + "…"
