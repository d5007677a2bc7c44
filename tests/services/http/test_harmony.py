"""gpt-oss's harmony answers (recorded shapes of its channels) read back as reasoning, content and calls; streamed
in any pieces, the deltas assemble to the whole answer's."""

from __future__ import annotations

import pytest

from services.http.reasoning.harmony import HarmonyAnswer, HarmonyCall, HarmonyStream, parse

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
    "call": (WEATHER, HarmonyAnswer(
        "User asks the weather in Tokyo. Need to call get_weather.", "",
        [HarmonyCall("get_weather", '{"location":"Tokyo"}')])),
    "answer": (ANSWER, HarmonyAnswer("Simple: 2 < 3 and 2+2=4.", "2 + 2 = 4.", [])),
    "two calls": (RECIPIENT_FIRST, HarmonyAnswer(
        "Look both up.", "Checking both.",
        [HarmonyCall("lookup", '{"q": "a<b"}'), HarmonyCall("lookup", '{"q": "c"}')])),
    "cut by max_tokens": ("<|channel|>analysis<|message|>Thinking about", HarmonyAnswer("Thinking about", "", [])),
    "plain text": ("Hello <there>", HarmonyAnswer(None, "Hello <there>", [])),
    "header without a body": ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin",
                              HarmonyAnswer("hm", "", [])),
    "unparsable arguments": (
        "<|channel|>commentary to=functions.f json<|message|>{not json<|call|>",
        HarmonyAnswer(None, "", [HarmonyCall("f", "{not json")])),
}  # fmt: skip


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_answers(name):
    text, want = RECORDED[name]
    assert parse(text) == want


def _assembled(text: str, size: int) -> HarmonyAnswer:
    stream, reasoning, content, calls = HarmonyStream(), None, "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        for delta in stream.push(piece, final=k == len(pieces) - 1):
            if delta[0] == "reasoning":
                reasoning = (reasoning or "") + delta[1]
            elif delta[0] == "content":
                content += delta[1]
            elif delta[2] is not None:
                assert delta[1] == len(calls)  # a new call: the next index, with its name
                calls.append(HarmonyCall(delta[2], delta[3]))
            else:
                calls[delta[1]] = HarmonyCall(calls[delta[1]].name, calls[delta[1]].arguments + delta[3])
    return HarmonyAnswer(reasoning, content, calls)


@pytest.mark.parametrize("name", RECORDED)
@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_streamed_equals_whole(name, size):
    text, want = RECORDED[name]
    assert _assembled(text, size) == want


def test_a_marker_is_held_until_decided():
    stream = HarmonyStream()
    assert stream.push("<|channel|>final<|message|>Hi <") == [("content", "Hi ")]
    assert stream.push("|ret") == []
    assert stream.push("urn|>", final=True) == []
