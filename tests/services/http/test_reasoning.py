"""Reasoning apart: `<think>` spans split from the answer, opened in the prompt or by the model, streamed."""

from __future__ import annotations

import pytest

from services.http.reasoning import ReasoningStream, ThinkTagsParser, choose

CASES = [
    ("I think so.\n</think>\n\nAnswer!", True, "I think so.\n", "Answer!"),  # DeepSeek-R1: opened in the prompt
    ("<think>hmm</think>ok", False, "hmm", "ok"),  # Qwen3: the model opens it
    ("Just answer", False, None, "Just answer"),  # enable_thinking false: no reasoning
    ("cut in the middle", True, "cut in the middle", ""),
    ("<thi", False, None, "<thi"),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_split_and_stream(text, opened, reasoning, content):
    parser = ThinkTagsParser()
    assert parser.split(text, opened) == (reasoning, content)
    for step in (1, 4):
        stream = ReasoningStream(parser, opened)
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        deltas = [d for i, p in enumerate(pieces) for d in stream.push(p, i == len(pieces) - 1)]
        assert "".join(t for k, t in deltas if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t in deltas if k == "content") == content


def test_opened_in_prompt_and_chooser():
    parser = ThinkTagsParser()
    assert parser.opened_in("<|Assistant|><think>\n")
    assert not parser.opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert choose("{{ '<think>' }}...{{ '</think>' }}").name == "think"
    assert choose("{{ messages }}") is None
    assert choose("</think>", "none") is None
