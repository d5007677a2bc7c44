"""Pieces of the formats' Lark grammars: a marker as text or as its special token, and the call object of each
function (its name fixed, its arguments by the function's JSON schema) with no free whitespace."""

from __future__ import annotations

import json
from typing import Any

# fixed separators (those of the templates' `tojson`): the model's own spacing, and no room for runaway blanks
WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def literal(marker: str, specials: dict[str, int]) -> str:
    """A marker in a Lark rule: its special token where the tokenizer has one, else its text."""
    if marker in specials:
        return f"<[{specials[marker]}]>"
    return json.dumps(marker)


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    if params is None:
        params = function.get("arguments")
    return params if isinstance(params, dict) and params else {"type": "object"}


def call_objects(functions: list[dict[str, Any]], arguments_key: str) -> str:
    """`%json {anyOf: [{"name": <const>, <arguments_key>: <schema>}, …]}`: name first, as the formats write it."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, arguments_key: parameters(f)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return "%json " + json.dumps({**schema, "x-guidance": WHITESPACE})
