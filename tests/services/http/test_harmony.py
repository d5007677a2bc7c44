"""gpt-oss's harmony answers (recorded shapes of its channels) read back as reasoning, content and calls by the
chat answer reader (the harmony reasoning parser, then the harmony tool-call parser); streamed in any pieces, the
deltas assemble to the whole answer's."""

from __future__ import annotations

import pytest

from services.http import reasoning, tool_parsers
from services.http.openai.answer import AnswerReader
from services.http.reasoning.harmony import HarmonyParser
from services.http.tool_parsers.harmony import HarmonyToolParser

WEATHER = (
    "<|channel|>analysis<|message|>User asks the weather in Tokyo. Need to call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"location":"Tokyo"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>Simple: 2 < 3 and 2+2=4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
RECIPIENT_FIRST = (  # the recipient in the role part of the header, two calls after a preamble
    "<|channel|>analysis<|message|>Look both up.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "a<b"}<|call|>'
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "c"}<|call|>'
)
RECORDED = {
    "call": (WEATHER, ("User asks the weather in Tokyo. Need to call get_weather.", "",
                       [("get_weather", '{"location":"Tokyo"}')])),
    "answer": (ANSWER, ("Simple: 2 < 3 and 2+2=4.", "2 + 2 = 4.", [])),
    "two calls": (RECIPIENT_FIRST, ("Look both up.", "Checking both.",
                                    [("lookup", '{"q": "a<b"}'), ("lookup", '{"q": "c"}')])),
    "cut by max_tokens": ("<|channel|>analysis<|message|>Thinking about", ("Thinking about", "", [])),
    "plain text": ("Hello <there>", (None, "Hello <there>", [])),
    "header without a body": ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin",
                              ("hm", "", [])),
    "unparsable arguments": ("<|channel|>commentary to=functions.f json<|message|>{not json<|call|>",
                             (None, "", [("f", "{not json")])),
    "recipient first, after the prompt's <|start|>assistant": (
        ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>', (None, "", [("f", '{"a": 1}')])),
}  # fmt: skip


def _reader() -> AnswerReader:
    # as ChatFormat builds it for a harmony template: the reasoning parser, then the harmony tool parser
    return AnswerReader(tool_parsers.choose("", "openai"), reasoning.choose("", "harmony"), True, False, True)


def _whole(text: str) -> tuple:
    answer = _reader().read(text)
    return answer.reasoning, answer.content or "", [(c.name, c.arguments) for c in answer.calls]


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_answers(name):
    text, want = RECORDED[name]
    assert _whole(text) == want


def _assembled(text: str, size: int) -> tuple:
    stream, reasoning, content, calls = _reader().stream(), None, "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        for delta in stream.push(piece, final=k == len(pieces) - 1):
            if delta[0] == "reasoning":
                reasoning = (reasoning or "") + delta[1]
            elif delta[0] == "content":
                content += delta[1]
            elif delta[1].name is not None:
                assert delta[1].call == len(calls)  # a new call: the next index, with its name
                calls.append((delta[1].name, delta[1].arguments))
            else:
                name, arguments = calls[delta[1].call]
                calls[delta[1].call] = (name, arguments + delta[1].arguments)
    return reasoning, content, calls


@pytest.mark.parametrize("name", RECORDED)
@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_streamed_equals_whole(name, size):
    text, want = RECORDED[name]
    assert _assembled(text, size) == want


def test_a_marker_is_held_until_decided():
    stream = _reader().stream()
    assert stream.push("<|channel|>final<|message|>Hi <") == [("content", "Hi ")]
    assert stream.push("|ret") == []
    assert stream.push("urn|>", final=True) == []


def test_chosen_from_the_template():
    template = "{{- '<|start|>assistant<|channel|>final<|message|>' + m + '<|return|>' -}}"
    assert isinstance(reasoning.choose(template), HarmonyParser) and HarmonyParser().keeps_special_tokens
    assert HarmonyParser().opened_in("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert isinstance(tool_parsers.choose("... to=functions.NAME <|call|>"), HarmonyToolParser)
    assert reasoning.choose("<think></think>").name == "think"  # other templates keep theirs
