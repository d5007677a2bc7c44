"""Whether the served chat format is written in special tokens, so the answer's text must keep them.

gpt-oss's harmony marks its channels, calls and ends with special tokens (`<|channel|>`, `<|message|>`, `<|call|>`,
…); read without them its reasoning, answer and calls run together. The reasoning and tool-call parsers say so
(`keeps_special_tokens`), chosen from the chat template and the flags exactly as the tokenizer and http choose them.
"""

from __future__ import annotations

from libs.runtime.settings import Settings
from services.http import reasoning, tool_parsers
from services.tokenizer.chat_template import ChatTemplates


def keeps_special_tokens(settings: Settings) -> bool:
    try:
        templates = ChatTemplates.load(settings.model_path, settings.chat_template)
    except Exception:  # no readable template: plain text, as the tokenizer serves it
        return False
    parsers = (
        reasoning.choose(templates.source(tools=False), settings.reasoning_parser),
        tool_parsers.choose(templates.source(), settings.tool_call_parser),
    )
    return any(getattr(p, "keeps_special_tokens", False) for p in parsers)
