"""Pythonic calls (Llama 3.2 / 4, ToolACE): the whole answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), now()]`, optionally inside `<|python_start|>…<|python_end|>`. The arguments come
back as JSON. A call is streamed whole, once the list up to it parses."""

from __future__ import annotations

import ast
import json
from typing import Any

from services.http.tool_parsers.base import BLANK, Call, ToolParser
from services.http.tool_parsers.grammar import WHITESPACE, parameters

OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
# a plain answer under `auto`: anything whose first visible character is not `[` (that one starts the calls)
CONTENT = r"/[ \t\r\n]*([^\[ \t\r\n][\s\S]*)?/"
_NAMES = {"true": True, "false": False, "null": None}  # JSON spellings, as a constrained answer writes them


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _calls(source: str) -> list[Call] | None:
    try:
        tree = ast.parse(source.strip(BLANK), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            args = {k.arg: _value(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError):
            return None
        calls.append(Call(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


class PythonicParser(ToolParser):
    name = "pythonic"
    trigger = None

    def scan(self, text: str, final: bool) -> list[str | Call]:
        body = text.strip(BLANK)
        body = body.removeprefix(OPEN).removesuffix(CLOSE) if body.startswith(OPEN) else body
        if not body or (not final and OPEN.startswith(body)):
            return [text] if final and text else []
        if not body.lstrip(BLANK).startswith("["):
            return [text]
        if final:
            calls = _calls(body)
            return [text] if calls is None else list(calls)
        # the calls complete so far: the list cut after its last `)`
        cut = body.rfind(")")
        return list(_calls(body[: cut + 1] + "]") or []) if cut >= 0 else []

    def grammar(self, functions: list[dict[str, Any]], mode: str, parallel: bool, specials: dict[str, int]) -> str:
        lines, names = [], []
        for i, f in enumerate(functions):
            props = parameters(f).get("properties") or {}
            args = [
                f'"{k}=" %json {json.dumps({**(v if isinstance(v, dict) else {}), "x-guidance": WHITESPACE})}'
                for k, v in props.items()
            ]
            lines.append(f"arg{i}: " + (" | ".join(args) if args else '""'))
            lines.append(f'call{i}: "{f["name"]}(" (arg{i} (", " arg{i})*)? ")"')
            names.append(f"call{i}")
        lines.append("call: " + " | ".join(names))
        more = ' (", " call)*' if parallel else ""
        lines.append(f'calls: "[" call{more} "]"')
        lines.append(f"start: calls | CONTENT\nCONTENT: {CONTENT}" if mode == "auto" else "start: calls")
        return "\n".join(lines) + "\n"
