"""Mistral calls: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` after any content. `[TOOL_CALLS]` is a special
token in Mistral's tokenizers, so the text often lacks it: an answer that begins with `[{` is read as calls too."""

from __future__ import annotations

from typing import Any

from services.http.tool_parsers.base import BLANK, Call, ToolParser, held_prefix
from services.http.tool_parsers.grammar import call_objects, literal
from services.http.tool_parsers.json_sequence import read_calls

MARK = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    trigger = MARK

    def scan(self, text: str, final: bool) -> list[str | Call]:
        at = text.find(MARK)
        lead = len(text) - len(text.lstrip(BLANK))
        if at >= 0:
            content, pos = text[:at], at + len(MARK)
        elif text.startswith("[{", lead):
            content, pos = text[:lead], lead
        elif not final and ("[{".startswith(text[lead:]) and lead < len(text) or lead == len(text)):
            return []  # may still become `[{`
        else:
            return [text if final else text[: len(text) - held_prefix(text, MARK)]]
        pos = len(text) - len(text[pos:].lstrip(BLANK))
        if pos == len(text) or not text.startswith("[", pos):
            return [content, text[at:]] if final and pos < len(text) else [content]
        calls, end, _ = read_calls(text, pos + 1, final, separators=",", close="]")
        out: list[str | Call] = [content, *calls]
        if final and not calls:
            return [text]
        if final and text[end:].strip(BLANK):
            out.append(text[end:])
        return out

    def grammar(self, functions: list[dict[str, Any]], mode: str, parallel: bool, specials: dict[str, int]) -> str:
        more = ' (", " call_object)*' if parallel else ""
        mark = literal(MARK, specials)
        lines = [f"call_object: {call_objects(functions, 'arguments')}", f'calls: "[" call_object{more} "]"']
        if mode != "auto":
            lines.append(f"start: {mark} calls")
        elif MARK in specials:  # text cannot hold a special token: the token itself opens the calls
            lines += [f"start: TEXT ({mark} calls)?", "TEXT: /(?s:.*)/"]
        else:
            lines += ["start: TEXT | head calls", f"head[lazy]: TEXT {mark}", "TEXT: /(?s:.*)/"]
        return "\n".join(lines) + "\n"
