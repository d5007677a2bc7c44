"""Llama 3.1 / 3.2 JSON calls: the whole answer is `{"name": …, "parameters": {…}}` (several joined by `; `),
optionally after `<|python_tag|>` (often a special token, then absent from the text); any other answer is content."""

from __future__ import annotations

from typing import Any

from services.http.tool_parsers.base import BLANK, Call, ToolParser
from services.http.tool_parsers.grammar import call_objects
from services.http.tool_parsers.json_sequence import read_calls

TAG = "<|python_tag|>"
# a plain answer under `auto`: anything whose first visible character is not `{` (that one starts a call)
CONTENT = r"/[ \t\r\n]*([^{ \t\r\n][\s\S]*)?/"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    trigger = None

    def scan(self, text: str, final: bool) -> list[str | Call]:
        pos = len(text) - len(text.lstrip(BLANK))
        if text.startswith(TAG, pos):
            pos += len(TAG)
            pos = len(text) - len(text[pos:].lstrip(BLANK))
        elif not final and TAG.startswith(text[pos:]):
            return []  # blanks or the start of the tag: undecided
        if not text.startswith("{", pos):
            if not final and pos == len(text):
                return []
            return [text]
        calls, end, _ = read_calls(text, pos, final, separators=";")
        if not calls:
            return [text] if final else []
        rest = text[end:]
        return [*calls, rest] if final and rest.strip(BLANK) else calls

    def grammar(self, functions: list[dict[str, Any]], mode: str, parallel: bool, specials: dict[str, int]) -> str:
        more = ' ("; " call_object)*' if parallel else ""
        lines = [f"call_object: {call_objects(functions, 'parameters')}", f"calls: call_object{more}"]
        lines.append(f"start: calls | CONTENT\nCONTENT: {CONTENT}" if mode == "auto" else "start: calls")
        return "\n".join(lines) + "\n"
