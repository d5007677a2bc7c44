"""What every tool-call format shares: the parsed call, the scan → parse / stream machinery, the JSON call object.

A format is a `ToolParser` subclass with one method, `scan(text, final)`: the generated text so far → its pieces,
in order: content strings and `Call`s. With `final=False` it returns only what is certain (text that may still
become a call marker is held back, a call's arguments end before what may be its closing braces), and what it
returns for a longer text extends what it returned for a shorter one. With `final=True` it is the whole answer.
`parse` is `scan(text, final=True)`; `ToolCallStream` diffs successive scans into deltas, so a stream's deltas
assemble to exactly what `parse` gives for the same text.

A format also writes its own call syntax as an llguidance Lark grammar (`grammar`) for the tokenizer, which
constrains the answer under tool_choice `required`, a named function, and (lazily, from the call's trigger) `auto`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

BLANK = " \t\r\n"
_DECODER = json.JSONDecoder()
# the head of a call object, up to its arguments value: `{"name": "...", "arguments": ` (or "parameters")
CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class Call(NamedTuple):
    """A tool call: the function's name and its arguments as JSON text (what OpenAI's `arguments` carries)."""

    name: str
    arguments: str


class ParsedCall(NamedTuple):
    """A call of the answer, with the id and index it is sent under."""

    index: int
    id: str
    name: str
    arguments: str


class ToolDelta(NamedTuple):
    """A piece of a streamed answer: content (`call` None) or a call's piece (`name` only on its first)."""

    content: str = ""
    call: int | None = None  # the call's index
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the start of `marker` (held back: it may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def json_string(raw: str) -> str:
    return json.loads(f'"{raw}"')


def read_call_object(text: str, start: int, complete: bool) -> tuple[Call | None, int | None]:
    """A `{"name": …, "arguments": {…}}` object at `start` → (call so far, end of the object or None).

    The arguments are the model's own text of the value (so stream pieces add up to it). While the object is
    open, the arguments end before trailing blanks and braces (they may close the value or the object). An
    object whose name does not come first is read only once complete (its arguments then as compact JSON).
    (None, None): not (yet) a call object.
    """
    head = CALL_HEAD.match(text, start)
    if head is None:
        if not complete:
            return None, None
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:
            return None, None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, None
        arguments = value.get("arguments", value.get("parameters", {}))
        return Call(value["name"], json.dumps(arguments, ensure_ascii=False)), end
    name = json_string(head.group(1))
    try:
        _, args_end = _DECODER.raw_decode(text, head.end())
    except ValueError:
        args_end = None
    if args_end is not None:  # the value is complete (an object or array cannot grow once closed)
        close = len(text) - len(text[args_end:].lstrip(BLANK))
        closed = close < len(text) and text[close] == "}"
        return Call(name, text[head.end() : args_end]), close + 1 if closed else None
    # the arguments are still open (or broken): hold back what may close them
    rest = text[head.end() :].rstrip(BLANK)
    if complete and rest.endswith("}"):
        rest = rest[:-1].rstrip(BLANK)
    return Call(name, rest if complete else rest.rstrip(BLANK + "}")), None


class ToolParser:
    """One tool-call format (see the module docstring); subclasses set `name` and implement `scan` and `grammar`."""

    name = ""
    # the text that starts a call; under `auto` the grammar constrains from it on (None: the whole answer decides)
    trigger: str | None = None

    def scan(self, text: str, final: bool) -> list[str | Call]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The whole answer → (content, calls); content is None when the answer is only calls."""
        pieces = self.scan(text, final=True)
        calls = [p for p in pieces if isinstance(p, Call)]
        content = "".join(p for p in pieces if isinstance(p, str))
        if calls and not content.strip(BLANK):
            return None, calls
        return content, calls

    def grammar(self, functions: list[dict[str, Any]], mode: str, parallel: bool, specials: dict[str, int]) -> str:
        """The Lark grammar of this format's calls of `functions` ({name, parameters}); mode: required | auto.
        `specials`: the tokenizer's special tokens by text (a marker that is one is written as its token)."""
        raise NotImplementedError


class ToolCallStream:
    """A stream's text pieces → ToolDeltas, by diffing successive scans (ids and indices stable per call)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.calls: list[tuple[str, int]] = []  # per call: its id, how much of its arguments was sent
        self.finished: list[ParsedCall] = []

    def push(self, piece: str, final: bool = False) -> list[ToolDelta]:
        self.text += piece
        pieces = self.parser.scan(self.text, final)
        out: list[ToolDelta] = []
        content = ""
        index = 0
        for p in pieces:
            if isinstance(p, str):
                content += p
                if len(content) > self.content_sent:
                    out.append(ToolDelta(content=content[self.content_sent :]))
                    self.content_sent = len(content)
                continue
            if index == len(self.calls):
                self.calls.append((call_id(), 0))
                out.append(ToolDelta(call=index, id=self.calls[index][0], name=p.name, arguments=p.arguments))
                self.calls[index] = (self.calls[index][0], len(p.arguments))
            else:
                cid, sent = self.calls[index]
                if len(p.arguments) > sent:
                    out.append(ToolDelta(call=index, arguments=p.arguments[sent:]))
                    self.calls[index] = (cid, len(p.arguments))
            if final:
                self.finished.append(ParsedCall(index, self.calls[index][0], p.name, p.arguments))
            index += 1
        return out

    @property
    def called(self) -> bool:
        return bool(self.calls)
