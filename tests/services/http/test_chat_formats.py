"""A chat answer is read in the format of the model the request is for (services/http/chat_formats.py): another
served model's tool calls and reasoning by the chat format its tokenizer announces in its heartbeat (Qwen3's
template here: `<think>` and `<tool_call>`), the local model's (no template: TGI's way, plain text) by its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libs.protocol.messages import ChatFormatNote, Heartbeat
from libs.runtime.liveness import Liveness
from libs.runtime.settings import Settings
from services.http import models
from services.http.chat_formats import ChatFormats
from services.http.tool_parsers.hermes import HermesParser
from tests.services.http.fakes import FakeIngress, client, rows, run

LOCAL, OTHER = "org/tiny", "model-b"  # fakes.client serves org/tiny, with no folder: no template
QWEN3 = (Path(__file__).parents[2] / "data" / "chat_templates" / "qwen3.jinja").read_text()
ANSWER = [
    "<think>",
    "weigh it",
    "</think>\n\n",
    '<tool_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Oslo"}}\n</tool_call>',
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def beat(role: str, index: int, **kw) -> Heartbeat:
    return Heartbeat(role=role, index=index, pid=os.getpid(), **kw)


@pytest.fixture
def fleet(monkeypatch):
    liveness = Liveness()
    for hb in (
        beat("scheduler", 0, model=LOCAL),
        beat("scheduler", 1, model=OTHER),
        beat("tokenizer", 0, model=LOCAL),
        beat("tokenizer", 1, model=OTHER, chat_format=ChatFormatNote(templates={"default": QWEN3})),
    ):
        liveness.record(hb)
    fleet = models.Fleet()
    fleet.attach(liveness, LOCAL)
    monkeypatch.setattr(models, "FLEET", fleet)
    return liveness


def answer(req, n):
    return rows(req.request_id, ANSWER, [-0.5] * len(ANSWER), finish="eos_token")


def test_each_model_is_read_in_its_own_format(fleet):
    async def scenario():
        async with client(FakeIngress(answer)) as c:
            out = []
            for model in (OTHER, "tgi"):
                body = {"model": model, "messages": [{"role": "user", "content": "Oslo?"}], "tools": TOOLS}
                out.append(await (await c.post("/v1/chat/completions", json=body)).json())
            body = {"model": OTHER, "max_tokens": 9, "messages": [{"role": "user", "content": "Oslo?"}]}
            tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
            out.append(await (await c.post("/v1/messages", json={**body, "tools": tools})).json())
            return out

    other, local, anthropic = run(scenario())
    choice = other["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "weigh it"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    # the local model has no template: its answer is text, the very same tokens
    assert local["choices"][0]["message"]["content"] == "".join(ANSWER)
    assert not local["choices"][0]["message"].get("tool_calls")
    # the Messages API reads through the same choice
    assert [b["type"] for b in anthropic["content"]] == ["thinking", "tool_use"]
    assert anthropic["content"][1]["input"] == {"city": "Oslo"} and anthropic["stop_reason"] == "tool_use"


def test_the_announcement_is_built_once_and_followed(fleet):
    formats = ChatFormats(Settings(model_id=LOCAL))
    first = formats.of(OTHER)
    assert formats.of(OTHER) is first and isinstance(first.parser(None), HermesParser)
    assert formats.of("") is formats.local is formats.of(LOCAL) and formats.local.parser(None) is None
    # its tokenizer restarts with another template (--tool-call-parser tgi): the format follows it
    fleet.record(beat("tokenizer", 1, model=OTHER, chat_format=ChatFormatNote(templates={}, tool_call_parser="tgi")))
    assert formats.of(OTHER) is not first and formats.of(OTHER).parser(None) is None
    # a tokenizer that announces nothing (an older one): the local model's format, as before
    fleet.record(beat("tokenizer", 1, model=OTHER))
    assert formats.of(OTHER) is formats.local
