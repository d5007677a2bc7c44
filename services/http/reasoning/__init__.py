"""Reasoning kept apart from the answer: `reasoning_content` (and `reasoning`) beside `content`.

One parser per format, one file each: `think_tags` (`<think>…</think>`: DeepSeek-R1, Qwen3, QwQ, GLM-4.5). vLLM's
flag names for it (`deepseek_r1`, `qwen3`, `glm45`) all select it. `harmony` (gpt-oss's channels: reasoning, content
and tool calls in one format; vLLM's `openai_gptoss`) is chosen for a template that writes `<|channel|>`; it reads an
answer whose special tokens were kept (`parser.keeps_special_tokens`).

Interface:
- `choose(template, flag)` → the parser for a chat template's text, or the one `--reasoning-parser` names
  (`none`: no split); None when the template shows no reasoning markers;
- `parser.opened_in(prompt)` → whether the rendered prompt leaves the reasoning open (the answer starts in it);
- `parser.split(text, opened)` → Split(reasoning or None, content) of the whole answer;
- `ReasoningStream(parser, opened).push(piece, final)` → [("reasoning" | "content", text)], assembling to `split`.
- `parser.start` / `parser.end`: the markers (the tokenizer's thinking budget writes `end` itself).
"""

from __future__ import annotations

from services.http.reasoning.harmony import HarmonyParser
from services.http.reasoning.think_tags import ReasoningStream, Split, ThinkTagsParser

PARSERS = {
    "think": ThinkTagsParser,
    "deepseek_r1": ThinkTagsParser,
    "qwen3": ThinkTagsParser,
    "glm45": ThinkTagsParser,
    "harmony": HarmonyParser,
    "openai_gptoss": HarmonyParser,
}
NONE = "none"
NAMES = (NONE, *PARSERS)


def choose(template: str, flag: str = "") -> ThinkTagsParser | HarmonyParser | None:
    if flag == NONE:
        return None
    if flag:
        return PARSERS[flag]()
    if "<|channel|>" in template:
        return HarmonyParser()
    if "</think>" in template:
        return ThinkTagsParser()
    return None


__all__ = ["NAMES", "PARSERS", "HarmonyParser", "ReasoningStream", "Split", "ThinkTagsParser", "choose"]
