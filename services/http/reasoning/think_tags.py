"""Reasoning between `<think>` and `</think>` (DeepSeek-R1 and its distills, Qwen3, QwQ, GLM-4.5, …), split on the
text: a tokenizer may have no special token for the tags (and a special one is dropped from the text anyway).

The opening tag may sit in the prompt (DeepSeek-R1's template and QwQ's end the generation prompt with `<think>\\n`):
then the answer starts inside the reasoning. Otherwise reasoning is what the answer opens with `<think>`; an answer
that opens with anything else is all content (Qwen3 with `enable_thinking` false closes an empty block in the prompt).
"""

from __future__ import annotations

from typing import NamedTuple

BLANK = " \t\r\n"


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class Split(NamedTuple):
    reasoning: str | None  # None: the answer has no reasoning part
    content: str


class ThinkTagsParser:
    name = "think"
    start, end = "<think>", "</think>"

    def opened_in(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves the reasoning open (its last `<think>` after its last `</think>`)."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def scan(self, text: str, opened: bool, final: bool) -> Split:
        """The answer so far → (reasoning, content), holding back what may become a tag (see ToolParser.scan)."""
        pos = 0
        if not opened:
            lead = len(text) - len(text.lstrip(BLANK))
            rest = text[lead:]
            if rest.startswith(self.start):
                pos = lead + len(self.start)
            elif not final and self.start.startswith(rest):
                return Split(None, "")  # blanks or the start of `<think>`: undecided
            else:
                return Split(None, text)
        at = text.find(self.end, pos)
        if at < 0:
            body = text[pos:]
            return Split(body if final else body[: len(body) - _held(body, self.end)], "")
        return Split(
            text[pos:at], text[at + len(self.end) :].lstrip(BLANK) if final else _content(text, at + len(self.end))
        )

    def split(self, text: str, opened: bool) -> Split:
        return self.scan(text, opened, final=True)


def _content(text: str, pos: int) -> str:
    # the blanks after `</think>` are the template's, not the answer's: dropped, and held while nothing else came
    return text[pos:].lstrip(BLANK)


class ReasoningStream:
    """A stream's text pieces → ("reasoning", text) / ("content", text) deltas that assemble to `split`."""

    def __init__(self, parser: ThinkTagsParser, opened: bool) -> None:
        self.parser, self.opened = parser, opened
        self.text = ""
        self.sent = [0, 0]  # reasoning, content

    def push(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        self.text += piece
        split = self.parser.scan(self.text, self.opened, final)
        out = []
        for i, (kind, value) in enumerate((("reasoning", split.reasoning or ""), ("content", split.content))):
            if len(value) > self.sent[i]:
                out.append((kind, value[self.sent[i] :]))
                self.sent[i] = len(value)
        return out
