"""The grammar of a chat answer in the model's own format: tool calls in its call syntax, reasoning first.

Where the template has a known tool-call format (services.http.tool_parsers.native_parser), tools are not TGI's
`{"function": {"_name": …}}` but the format's own calls: `tool_plan` resolves tool_choice (`none`: the template
still sees the tools, nothing is constrained; `auto`: free text, and from the format's trigger on a valid call;
`required` / a named function: only calls) into a Lark grammar whose JSON has fixed separators. `budget_lark`
bounds the reasoning a prompt leaves open (a thinking budget) in front of the answer's grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher

from services.http.reasoning.harmony import CHANNEL, END, MESSAGE, START
from services.http.tool_parsers import ToolParser
from services.http.tool_parsers.grammar import literal
from services.tokenizer.grammar import (
    JSON_WHITESPACE,
    GrammarLimits,
    ToolError,
    ToolPlan,
    _choice_name,
    _closed,
    _function,
    _schema,
)


def _functions(tools: list[dict]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        fn = _function(tool)
        params = fn.get("parameters") if fn.get("parameters") is not None else fn.get("arguments")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"the parameters of function {fn['name']} must be a JSON schema object")
        out.append({"name": fn["name"], "parameters": params})
    return out


def tool_plan(
    parser: ToolParser,
    tools: list[dict] | None,
    tool_choice: Any,
    *,
    parallel: bool = True,
    specials: dict[str, int] | None = None,
    has_grammar: bool = False,
    limits: GrammarLimits = GrammarLimits(),
) -> ToolPlan:
    """tools + tool_choice → what the template sees and the Lark grammar of the answer (ToolPlan.lark)."""
    if tools is not None and has_grammar:
        raise ToolError("Grammar and tools are mutually exclusive")
    if not tools:
        return ToolPlan(None, None, None)
    choice = _choice_name(tool_choice)
    if choice == "none":
        return ToolPlan(list(tools), None, None)
    if choice not in ("auto", "required"):
        chosen = [t for t in tools if _function(t)["name"] == choice]
        if not chosen:
            raise ToolError(f"Tool with name {choice} not found")
    else:
        chosen = list(tools)
    functions = _functions(chosen)
    for f in functions:  # the size and depth limits hold for every schema
        if f["parameters"] is not None:
            _schema(f["parameters"], limits)
    mode = "auto" if choice == "auto" else "required"
    lark = parser.grammar(functions, mode, parallel and choice in ("auto", "required"), specials or {})
    kind = "tools_auto" if mode == "auto" else "tools"
    return ToolPlan(list(tools), kind, None, lark)


_START = re.compile(r"^start(\[[^\]]*\])?:", re.MULTILINE)


def budget_lark(end: str, budget: int | None, answer: str | None = None, end_id: int | None = None) -> str:
    """Reasoning, for a prompt that leaves it open, then `end`, then the answer: free text, or `answer`'s Lark rules
    (a tool grammar, a JSON schema's) whose `start` becomes the answer's. Under a thinking budget at most `budget`
    tokens of reasoning (at the budget the grammar allows only `end`, so the server writes it).

    llguidance's lexer is greedy (a lexeme ends only where the next byte cannot extend it), so the model's own
    marker cannot be a lexeme of its own after free text that may go on with the marker's first character. Without
    a budget the reasoning is one lexeme up to and with the first `end` (any text, `<` included). Under a budget,
    where the tokenizer has `end` as one token (`end_id`), the marker is that token: the reasoning is any text
    without the marker's text, so it ends where the model samples the marker's token (or the budget forces it), and
    may hold `<`. Where the marker is several tokens the reasoning may not hold its first character: the lexeme
    that holds `end` is not cut by `max_tokens`, and text cut at the budget beside it no longer hands over to the
    model's own marker."""
    if answer is None:
        rules = ["sy_answer: /(?s:.*)/"]
    else:
        rules = [_START.sub(r"sy_answer\1:", answer)]
    marker = re.escape(end).replace("/", "\\/")
    if budget is None:
        rules += [
            "start: sy_think sy_answer",
            "sy_think: SY_ENDED",
            f"SY_ENDED: /(?s:.*){marker}/ & ~/(?s:.*){marker}(?s:.+)/",
        ]
    elif end_id is not None:
        rules += [
            f"start: sy_think <[{int(end_id)}]> sy_answer",
            f"sy_think[max_tokens={int(budget)}]: SY_THINK",
            f"SY_THINK: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/",
        ]
    else:
        first = re.escape(end[0]).replace("/", "\\/")
        rules += [
            f"start: sy_think {json.dumps(end)} sy_answer",
            f"sy_think[max_tokens={int(budget)}]: SY_THINK",
            f"SY_THINK: /[^{first}]*/",
        ]
    return "\n".join(rules) + "\n"


def marker_token(tokenizer, marker: str) -> int | None:
    """The id of the one token that is `marker` in this tokenizer (an added token, special or not, or a vocabulary
    entry), else None."""
    ids = tokenizer.encode(marker, add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 else None


def harmony_lark(specials: dict[str, int], budget: int | None, answer: str | None = None, calls: bool = False) -> str:
    """gpt-oss's harmony answer under a thinking budget or a format: an analysis message of at most `budget` tokens
    (free text, which cannot hold a special token, so the model's own `<|end|>` ends it and may come at any point;
    at the budget only `<|end|>` may follow), then `<|start|>assistant` and the answer: a final message (free, or
    `answer`'s rules: a JSON schema's) or, with `calls`, `answer`'s harmony tool grammar (its `sy_harmony_answer`)."""
    ch, msg, end, start = (literal(m, specials) for m in (CHANNEL, MESSAGE, END, START))
    limit = "" if budget is None else f"[max_tokens={int(budget)}]"
    rules = [
        f'start: {ch} "analysis" {msg} sy_think {end} {start} "assistant" sy_answer',
        f"sy_think{limit}: SY_THINK",
        "SY_THINK: /(?s:.*)/",
    ]
    if calls and answer is not None:
        rules += [_START.sub(r"sy_tools_start\1:", answer), "sy_answer: sy_harmony_answer"]
    elif answer is not None:
        rules += [_START.sub(r"sy_final\1:", answer), f'sy_answer: {ch} "final" {msg} sy_final']
    else:
        rules.append(f'sy_answer: {ch} "final" {msg} /(?s:.*)/')
    return "\n".join(rules) + "\n"


def reasoning_lark(parser, tokenizer, budget: int | None, answer: str | None = None, calls: bool = False) -> str:
    """The grammar of reasoning then the answer for `parser`'s format (budget_lark, or harmony_lark)."""
    if getattr(parser, "name", "") == "harmony":
        specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        return harmony_lark(specials, budget, answer, calls)
    return budget_lark(parser.end, budget, answer, marker_token(tokenizer, parser.end))


def json_answer_lark(schema: dict) -> str:
    """A JSON schema's answer as Lark rules for `budget_lark` (extra keys closed, whitespace bounded, as a
    response_format alone)."""
    guided = {**_closed(schema), "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return f"start: %json{json.dumps(guided)}\n"


def compiled(lark: str) -> str:
    return LLMatcher.grammar_from_lark(lark)


def answer_schema(value: Any, limits: GrammarLimits = GrammarLimits()) -> dict | None:
    """The JSON schema a JSON response_format (json, json_object, json_schema) asks of the answer; None for any
    other grammar (a regex or Lark grammar constrains the whole output, reasoning included)."""
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind == "json_object" and "value" not in value:
        return {"type": "object"}
    if kind in ("json", "json_object"):
        return _schema(value.get("value"), limits)
    if kind == "json_schema":
        inner = value.get("value") if "value" in value else value.get("json_schema")
        if isinstance(inner, dict) and "schema" in inner:
            return _schema(inner["schema"], limits)
    return None
