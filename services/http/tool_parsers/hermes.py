"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, any number of them,
text allowed before, between and after (the content)."""

from __future__ import annotations

from typing import Any

from services.http.tool_parsers.base import BLANK, Call, ToolParser, held_prefix, read_call_object
from services.http.tool_parsers.grammar import call_objects, literal

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    trigger = START

    def scan(self, text: str, final: bool) -> list[str | Call]:
        out: list[str | Call] = []
        pos = 0
        while True:
            at = text.find(START, pos)
            if at < 0:
                tail = text[pos:]
                out.append(tail if final else tail[: len(tail) - held_prefix(tail, START)])
                return out
            out.append(text[pos:at])
            body = at + len(START)
            end = text.find(END, body)
            closed = end >= 0
            inner = text[body : end if closed else len(text)]
            start = len(inner) - len(inner.lstrip(BLANK))
            call, _ = read_call_object(inner, start, complete=closed or final)
            if call is None:
                if not (closed or final):
                    return out  # held until the call reads as one or its block closes
                out.append(text[at : end + len(END) if closed else len(text)])  # not a call: content, as written
            else:
                out.append(call)
            if not closed:
                return out
            pos = end + len(END)

    def grammar(self, functions: list[dict[str, Any]], mode: str, parallel: bool, specials: dict[str, int]) -> str:
        start, end = literal(START, specials), literal(END, specials)
        call = f'{start} "\\n" call_object "\\n" {end}'
        lines = [f"call_object: {call_objects(functions, 'arguments')}"]
        if mode == "auto":  # any text; from a `<tool_call>` on, calls of the tools
            lines += [
                "start: call* TEXT",
                f'call: call_head "\\n" call_object "\\n" {end}',
                f"call_head[lazy]: TEXT {start}",
                "TEXT: /(?s:.*)/",
            ]
        else:
            more = ' ("\\n" call)*' if parallel else ""
            lines += [f"start: call{more}", f"call: {call}"]
        return "\n".join(lines) + "\n"
