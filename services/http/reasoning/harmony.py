"""gpt-oss's "harmony" answer: messages of channels, read back as reasoning, content and tool calls.

Each message is `[<|start|>assistant] header <|message|> body` ended by `<|end|>`, `<|return|>` or `<|call|>` (or
by the text's end, cut by max_tokens). The header names the channel (`<|channel|>analysis`) and a recipient
(`to=functions.NAME`, before or after the channel), then maybe a content type (`<|constrain|>json`):
- `analysis` → reasoning;
- `commentary` with `to=functions.NAME` → a call of NAME whose arguments are the body as written;
- `final`, and commentary without a recipient (a preamble) → content;
- text outside any header (a model that ignores the format) → content.

The markers are special tokens of gpt-oss's tokenizer: the text read here must keep them.
`HarmonyStream.push(piece, final)` gives deltas that assemble to exactly `parse` of the whole text: text that may
still become a marker (a trailing `<` or `<|…` without its `|>`) is held until it is decided.
"""

from __future__ import annotations

import re
from typing import NamedTuple

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
HEADER_OPENS = (START, CHANNEL)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyCall(NamedTuple):
    name: str
    arguments: str


class HarmonyAnswer(NamedTuple):
    reasoning: str | None  # None: no analysis message
    content: str
    calls: list[HarmonyCall]


def _decided(text: str) -> str:
    """The text less a tail that may still become a marker."""
    at = text.rfind("<|")
    if at >= 0 and text.find("|>", at + 2) < 0:
        return text[:at]
    return text[:-1] if text.endswith("<") else text


def _end(text: str, pos: int) -> tuple[int, int]:
    """(where the body from `pos` ends, where the next message begins): the first terminator, else the text's end."""
    hits = [(text.find(e, pos), len(e)) for e in ENDS]
    hits = [(at, n) for at, n in hits if at >= 0]
    if not hits:
        return len(text), len(text)
    at, n = min(hits)
    return at, at + n


def scan(text: str, final: bool) -> HarmonyAnswer:
    """The answer so far → its reasoning, content and calls (a call's arguments as far as written)."""
    if not final:
        text = _decided(text)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[HarmonyCall] = []
    pos = 0
    while pos < len(text):
        if not text.startswith(HEADER_OPENS, pos):  # text outside any header: content up to a marker
            nxt = [at for at in (text.find(m, pos) for m in (*HEADER_OPENS, *ENDS)) if at >= 0]
            stop = min(nxt) if nxt else len(text)
            content.append(text[pos:stop])
            pos = stop
            for e in ENDS:
                if text.startswith(e, pos):
                    pos += len(e)
            continue
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:  # a header not yet (or never) followed by its body
            break
        header = text[pos:body_at]
        end, pos = _end(text, body_at + len(MESSAGE))
        body = text[body_at + len(MESSAGE) : end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            calls.append(HarmonyCall(recipient.group(1), body))
        elif channel is not None and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return HarmonyAnswer("".join(reasoning) if reasoning else None, "".join(content), calls)


def parse(text: str) -> HarmonyAnswer:
    return scan(text, final=True)


class HarmonyStream:
    """A stream's text pieces → ("reasoning", text), ("content", text) and ("call", index, name or None, arguments
    piece) deltas; a call's first delta carries its name. They assemble to `parse` of the whole text."""

    def __init__(self) -> None:
        self.text = ""
        self.sent_reasoning = self.sent_content = 0
        self.sent_calls: list[int] = []  # per call: the arguments' length sent

    def push(self, piece: str, final: bool = False) -> list[tuple]:
        self.text += piece
        answer = scan(self.text, final)
        out: list[tuple] = []
        if answer.reasoning is not None and len(answer.reasoning) > self.sent_reasoning:
            out.append(("reasoning", answer.reasoning[self.sent_reasoning :]))
            self.sent_reasoning = len(answer.reasoning)
        if len(answer.content) > self.sent_content:
            out.append(("content", answer.content[self.sent_content :]))
            self.sent_content = len(answer.content)
        for i, call in enumerate(answer.calls):
            if i == len(self.sent_calls):
                self.sent_calls.append(len(call.arguments))
                out.append(("call", i, call.name, call.arguments))
            elif len(call.arguments) > self.sent_calls[i]:
                out.append(("call", i, None, call.arguments[self.sent_calls[i] :]))
                self.sent_calls[i] = len(call.arguments)
        return out
