"""gpt-oss's calls, in its harmony format: a commentary message addressed to a function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>` (the recipient may also stand
before the channel). `<|call|>` ends the turn, so a turn holds at most one call. The messages are read by
services.http.reasoning.harmony; here a call becomes a Call and every other message's body content (an analysis
message too, where no reasoning parser takes it out first).

The grammar writes the markers as their special tokens: the answer may open with analysis messages and commentary
preambles (free text, which cannot hold a special token, up to `<|end|>`), then comes the call (`required`, a named
function), or the call or a final message (`auto`). vLLM names this parser `openai`.
"""

from __future__ import annotations

import json
from typing import Any

from services.http.reasoning.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START, messages
from services.http.tool_parsers.base import Call, ToolParser
from services.http.tool_parsers.grammar import WHITESPACE, literal, parameters


class HarmonyToolParser(ToolParser):
    name = "openai"
    trigger = None
    keeps_special_tokens = True  # the format's markers are special tokens

    def scan(self, text: str, final: bool) -> list[str | Call]:
        out: list[str | Call] = []
        for m in messages(text, final):
            recipient = m.recipient
            out.append(m.body if recipient is None else Call(recipient, m.body))
        return out

    def grammar(self, functions: list[dict[str, Any]], mode: str, parallel: bool, specials: dict[str, int]) -> str:
        """`sy_harmony_answer` is what follows the reasoning (a thinking budget's grammar puts it after its own
        analysis message); `start` lets the answer open with analysis and preamble messages."""
        ch, msg, end, start, call, constrain = (
            literal(m, specials) for m in (CHANNEL, MESSAGE, END, START, CALL, CONSTRAIN)
        )
        lines = []
        names = []
        for i, f in enumerate(functions):
            arguments = "%json " + json.dumps({**parameters(f), "x-guidance": WHITESPACE})
            header = json.dumps(f"commentary to=functions.{f['name']} ")
            lines.append(f'sy_call_{i}: {ch} {header} {constrain} "json" {msg} {arguments} {call}')
            names.append(f"sy_call_{i}")
        lines.append(f"sy_harmony_call: {' | '.join(names)}")
        if mode == "auto":
            lines += [f'sy_harmony_answer: sy_harmony_call | {ch} "final" {msg} SY_TEXT', "SY_TEXT: /(?s:.*)/"]
        else:
            lines.append("sy_harmony_answer: sy_harmony_call")
        lines += [
            f'sy_lead: {ch} sy_lead_channel {msg} SY_LEAD {end} {start} "assistant"',
            'sy_lead_channel: "analysis" | "commentary"',
            "SY_LEAD: /(?s:.*)/",
            "start: sy_lead* sy_harmony_answer",
        ]
        return "\n".join(lines) + "\n"
