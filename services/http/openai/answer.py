"""A chat answer read back: reasoning, content and tool calls in the model's own format (or TGI's tool shape).

`ChatFormat` reads a model's chat template once and chooses the tool-call parser (services.http.tool_parsers) and
the reasoning parser (services.http.reasoning), as the tokenizer does from the same template and settings: the local
model's from its folder (`served`), another model's from what its tokenizers announce (`announced`;
services.http.chat_formats picks a request's). `ChatFormat.reader(body)` gives a request's `AnswerReader`:
- `read(text)` → Answer(reasoning, content, calls): the whole answer;
- `stream()` → an object whose `push(piece, final)` gives deltas ("reasoning", text), ("content", text) or
  ("call", ToolDelta), assembling to exactly `read` of the same text.
`reader.native` is False where TGI's way serves the request (services.http.openai.tools reads it then).
A format written in special tokens (gpt-oss's harmony) reads every token's text, the special ones included
(`piece`): its reasoning parser leaves the other messages in the format for its tool-call parser, which then reads
every answer, with or without tools.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from libs.protocol.messages import ChatFormatNote
from libs.runtime.settings import Settings
from services.http import reasoning as reasoning_parsers
from services.http import tool_parsers
from services.http.openai import requests as oa
from services.http.openai import tools
from services.http.tool_parsers import ParsedCall, ToolCallStream, ToolParser, call_id
from services.http.tool_parsers.harmony import HarmonyToolParser
from services.tokenizer.chat_template import ChatTemplates


class Answer(NamedTuple):
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


def _choice(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict):
        return "named"
    return tool_choice or "auto"


class AnswerReader:
    def __init__(self, parser: ToolParser | None, reasoning, opened: bool, tools_on: bool, native: bool) -> None:
        if getattr(reasoning, "keeps_special_tokens", False) and not isinstance(parser, HarmonyToolParser):
            parser = HarmonyToolParser()  # the content the harmony reasoning parser leaves is still in harmony
        self.keeps_special = getattr(reasoning, "keeps_special_tokens", False) or getattr(
            parser, "keeps_special_tokens", False
        )
        # a format written in special tokens is read by its own parser with tools or without
        self.parser = parser if tools_on or self.keeps_special else None
        self.reasoning, self.opened, self.native = reasoning, opened, native

    def _split(self, text: str) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text, self.opened)
        return split.reasoning, split.content

    def read(self, text: str) -> Answer:
        reasoning, content = self._split(text)
        if self.parser is None:
            return Answer(reasoning, content, [])
        rest, calls = self.parser.parse(content)
        return Answer(reasoning, rest, [ParsedCall(i, call_id(), c.name, c.arguments) for i, c in enumerate(calls)])

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


class AnswerStream:
    def __init__(self, reader: AnswerReader) -> None:
        self.reasoning = None
        if reader.reasoning is not None:
            self.reasoning = reasoning_parsers.ReasoningStream(reader.reasoning, reader.opened)
        self.tools = None if reader.parser is None else ToolCallStream(reader.parser)
        self.keeps_special = reader.keeps_special

    def piece(self, row) -> str:
        """A token's text as the answer reads it: a special token's text only where the format is written in them."""
        return row.text if self.keeps_special or not row.special else ""

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def push(self, piece: str, final: bool = False) -> list[tuple]:
        out: list[tuple] = []
        content = piece
        if self.reasoning is not None:
            content = ""
            for kind, text in self.reasoning.push(piece, final):
                if kind == "reasoning":
                    out.append(("reasoning", text))
                else:
                    content += text
        if self.tools is None:
            if content:
                out.append(("content", content))
            return out
        for delta in self.tools.push(content, final):
            out.append(("content", delta.content) if delta.call is None else ("call", delta))
        return out


class ChatFormat:
    """A model's template formats (see the module docstring): its templates and its parser flags ("": chosen from
    the template)."""

    def __init__(self, templates: ChatTemplates, tool_flag: str = "", reasoning_flag: str = "") -> None:
        self.templates = templates
        self.tool_flag = tool_flag
        self.reasoning = reasoning_parsers.choose(self.templates.source(tools=False), reasoning_flag)
        # the detokenizer keeps special tokens in the text (services.detokenizer.formats, the same choice)
        tool_format = tool_parsers.choose(self.templates.source(), self.tool_flag)
        self.keeps_special = any(getattr(p, "keeps_special_tokens", False) for p in (self.reasoning, tool_format))

    @classmethod
    def served(cls, settings: Settings) -> ChatFormat:
        """The local model's: its folder's template (or --chat-template) and the parser flags."""
        try:
            templates = ChatTemplates.load(settings.model_path, settings.chat_template)
        except Exception:  # no readable folder (tests without a model): plain text, TGI's way
            templates = ChatTemplates({})
        return cls(templates, settings.tool_call_parser, settings.reasoning_parser)

    @classmethod
    def announced(cls, note: ChatFormatNote) -> ChatFormat:
        """Another model's, as its tokenizer announces it (a parser name this process does not know: chosen from
        the template instead)."""
        templates = ChatTemplates(note.templates, note.bos_token, note.eos_token)
        tool_flag = note.tool_call_parser if note.tool_call_parser in tool_parsers.NAMES else ""
        reasoning_flag = note.reasoning_parser if note.reasoning_parser in reasoning_parsers.NAMES else ""
        return cls(templates, tool_flag, reasoning_flag)

    def parser(self, tool_prompt: str | None) -> ToolParser | None:
        t = self.templates
        return tool_parsers.native_parser(t.source(), t.uses_tools(), self.tool_flag, tool_prompt)

    def reader(
        self, tools: list | None, tool_choice: Any, tool_prompt: str | None, kwargs: dict | None
    ) -> AnswerReader:
        parser = self.parser(tool_prompt)
        opened = self.reasoning is not None and self.reasoning.opened_in(self.templates.probe(kwargs))
        tools_on = bool(tools) and _choice(tool_choice) != "none"
        return AnswerReader(parser, self.reasoning, opened, tools_on, parser is not None)

    def answer_mode(self, body, tool_choice: Any) -> AnswerReader | str | None:
        """How the answer to a chat body is read: the model's own format or its reasoning alone (an AnswerReader),
        TGI's tool mode ("auto" or "call", services.http.openai.tools), or None: plain text."""
        reader = self.reader(body.tools, tool_choice, body.tool_prompt, oa.template_kwargs(body))
        tgi = tools.tool_mode(body.tools, tool_choice)
        if not reader.native and tgi is not None:
            return tgi
        return reader if reader.native or reader.reasoning is not None else None
