"""gpt-oss's "harmony" answer: messages of channels, read back as reasoning, content and tool calls.

Each message is `[<|start|>assistant] header <|message|> body` ended by `<|end|>`, `<|return|>` or `<|call|>` (or
by the text's end, cut by max_tokens). The header names the channel (`<|channel|>analysis`) and a recipient
(`to=functions.NAME`, before or after the channel), then maybe a content type (`<|constrain|>json`):
- `analysis` → reasoning;
- `commentary` with `to=functions.NAME` → a call of NAME whose arguments are the body as written;
- `final`, and commentary without a recipient (a preamble) → content;
- text outside any header (a model that ignores the format) → content.

The generation prompt ends `<|start|>assistant`, so the answer opens inside its first header (`<|channel|>…` or
` to=functions.…`). The markers are special tokens of gpt-oss's tokenizer: the text read here must keep them
(`HarmonyParser.keeps_special_tokens`: the detokenizer and http keep them for a model served with this format).

`messages(text, final)` reads the answer so far into its messages; text that may still become a marker (a trailing
`<` or `<|…` without its `|>`) is held until it is decided, so what it gives for a longer text extends what it gave
for a shorter one. `HarmonyParser` is the reasoning parser (services.http.reasoning's interface): its content is
the answer's other messages, still in harmony (`<|start|>` header `<|message|>` body end), which the harmony
tool-call parser (services.http.tool_parsers.harmony) reads into content and calls.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from services.http.reasoning.think_tags import Split

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)
# what opens a header at a message's start: `<|start|>`, or (the prompt having written `<|start|>assistant`)
# the channel or the recipient
HEADER_OPENS = (START, CHANNEL, " to=", "to=")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class Message(NamedTuple):
    """One message of an answer: its header (None: text outside any header), its body so far and its end marker
    ("" while it may go on)."""

    header: str | None
    body: str
    end: str

    @property
    def channel(self) -> str | None:
        found = _CHANNEL.search(self.header or "")
        return found.group(1) if found else None

    @property
    def recipient(self) -> str | None:
        found = _RECIPIENT.search(self.header or "")
        return found.group(1) if found else None

    @property
    def reasoning(self) -> bool:
        return self.channel == "analysis" and self.recipient is None

    def harmony(self) -> str:
        """The message written back in harmony (a header always opened by `<|start|>`)."""
        if self.header is None:
            return self.body
        header = self.header[len(START) :] if self.header.startswith(START) else self.header
        return f"{START}{header}{MESSAGE}{self.body}{self.end}"


def _decided(text: str) -> str:
    """The text less a tail that may still become a marker."""
    at = text.rfind("<|")
    if at >= 0 and text.find("|>", at + 2) < 0:
        return text[:at]
    return text[:-1] if text.endswith("<") else text


def _opens_header(rest: str, final: bool) -> bool | None:
    """Whether the text at a message's start opens a header (None: not yet decided)."""
    if rest.startswith(HEADER_OPENS):
        return True
    if not final and any(o.startswith(rest) for o in HEADER_OPENS):
        return None
    return False


def _end(text: str, pos: int) -> tuple[int, int]:
    """(where the body from `pos` ends, where the next message begins): the first terminator, else the text's end."""
    hits = [(text.find(e, pos), len(e)) for e in ENDS]
    hits = [(at, n) for at, n in hits if at >= 0]
    if not hits:
        return len(text), len(text)
    at, n = min(hits)
    return at, at + n


def messages(text: str, final: bool) -> list[Message]:
    """The answer so far → its messages, each as far as decided (a header only once its `<|message|>` came)."""
    if not final:
        text = _decided(text)
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        opens = _opens_header(text[pos:], final)
        if opens is None:
            break
        if not opens:  # text outside any header: content up to a marker
            nxt = [at for at in (text.find(m, pos) for m in (START, CHANNEL, *ENDS)) if at >= 0]
            stop = min(nxt) if nxt else len(text)
            if stop > pos:
                out.append(Message(None, text[pos:stop], ""))
            pos = stop
            for e in ENDS:
                if text.startswith(e, pos):
                    pos += len(e)
            continue
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:  # a header not yet (or never) followed by its body
            break
        end, nxt = _end(text, body_at + len(MESSAGE))
        out.append(Message(text[pos:body_at], text[body_at + len(MESSAGE) : end], text[end:nxt]))
        pos = nxt
    return out


class HarmonyParser:
    """The reasoning parser of harmony answers: analysis messages are the reasoning, the other messages (still in
    harmony) the content that the harmony tool-call parser reads."""

    name = "harmony"
    keeps_special_tokens = True  # the format's markers are special tokens
    start, end = f"{CHANNEL}analysis{MESSAGE}", END

    def opened_in(self, prompt: str) -> bool:
        """Whether the rendered prompt opens the assistant's message (gpt-oss's generation prompt does)."""
        return prompt.rstrip().endswith(f"{START}assistant")

    def scan(self, text: str, opened: bool, final: bool) -> Split:
        found = messages(text, final)
        reasoning = [m.body for m in found if m.reasoning]
        rest = "".join(m.harmony() for m in found if not m.reasoning)
        return Split("".join(reasoning) if reasoning else None, rest)

    def split(self, text: str, opened: bool) -> Split:
        return self.scan(text, opened, final=True)
