"""The one chat path that the translation layers (the Responses API, Anthropic's Messages API) feed: an OpenAI
chat body (messages, tools, tool_choice, response_format, sampling) becomes the very GenerateRequest that
/v1/chat/completions sends (the tokenizer renders it through the model's chat template), and the generated text
is read back as content and tool calls, whole or as stream deltas.

Each layer translates its request into the chat body and the answer out of these deltas into its own shapes;
how a call is read out of the text (the format the grammar forces) lives in services.http.openai.tools alone.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from libs.protocol.messages import GenerateRequest
from services.http.errors import Failure
from services.http.generation import bus_request
from services.http.openai import requests as oa
from services.http.openai import tools


class ChatTurn(msgspec.Struct):
    """A translated request on its way: the chat body, its GenerateRequest, and how its answer is read."""

    body: oa.ChatRequest
    wire: GenerateRequest
    tool_mode: str | None  # None: plain text | "auto": text or a call | "call": a call (tools.tool_mode)


def chat_turn(request: web.Request, ingress: int, chat: dict[str, Any], model_id: str, mode: str = "generate"):
    """`chat` (an OpenAI chat body as a dict) → its ChatTurn, as /v1/chat/completions builds it; raises Failure.

    `top_k`, which OpenAI's chat lacks, is taken from the dict and set on the parameters."""
    top_k = chat.pop("top_k", None)
    try:
        body = msgspec.convert(chat, oa.ChatRequest)
    except msgspec.ValidationError as e:
        raise Failure(f"Invalid request: {e}", "validation") from None
    parameters = oa.chat_parameters(body, model_id)
    parameters.top_k = top_k
    tool_choice = msgspec.to_builtins(body.tool_choice)
    wire = bus_request(
        request,
        ingress,
        parameters,
        inputs="",
        add_special_tokens=False,  # the template holds the special tokens
        mode=mode,
        stream=body.stream,
        messages=body.messages,
        tools=body.tools,
        tool_choice=tool_choice,
        tool_prompt=body.tool_prompt,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    return ChatTurn(body, wire, tools.tool_mode(body.tools, tool_choice))


class Call(msgspec.Struct):
    """One tool call read out of an answer: the function's name and its arguments as the model wrote them."""

    name: str
    arguments: str


def read_answer(text: str, tool_mode: str | None) -> tuple[str, list[Call]]:
    """A whole answer → (its text, its calls); raises Failure (tool_error) for a call that does not parse."""
    if tool_mode == "call" or (tool_mode == "auto" and tools.is_call(text)):
        calls = tools.parse_tool_call(text)
        return "", [Call(c.function.name, c.function.arguments) for c in calls]
    return text, []


class AnswerStream:
    """A streamed answer's token texts → deltas: ("text", piece) or ("call", name, arguments piece); a call's
    first delta carries its name, the next ones None. The pieces add up to exactly `read_answer`'s."""

    def __init__(self, tool_mode: str | None) -> None:
        self.reader = None if tool_mode is None else tools.ToolStream(auto=tool_mode == "auto")

    def push(self, piece: str, final: bool) -> list[tuple]:
        if self.reader is None:
            return [("text", piece)] if piece else []
        out = []
        for delta in self.reader.push(piece, final):
            if delta[0] == "content":
                if delta[1]:
                    out.append(("text", delta[1]))
            else:
                out.append(("call", delta[1], delta[2]))
        return out
