"""The one chat path that the translation layers (the Responses API, Anthropic's Messages API) feed: an OpenAI
chat body (messages, tools, tool_choice, response_format, sampling) becomes the very GenerateRequest that
/v1/chat/completions sends (the tokenizer renders it through the model's chat template), and the generated text
is read back as reasoning, content and tool calls, whole or as stream deltas (stream_turn writes them as the
layer's own events).

Each layer translates its request into the chat body and the answer out of these deltas into its own shapes.
How the text is read is chosen as /v1/chat/completions chooses it: the model's own format where the template's
is known (services.http.openai.answer: its tool-call and reasoning parsers; the format of the model the request is
for, services.http.chat_formats), else TGI's tool shape (services.http.openai.tools).
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from aiohttp import web

from libs.protocol.messages import GenerateRequest
from libs.protocol.params import Parameters
from services.http.chat_formats import ChatFormats
from services.http.errors import Failure
from services.http.generation import bus_request
from services.http.openai import requests as oa
from services.http.openai import tools
from services.http.openai.answer import AnswerReader
from services.http.responses import open_stream
from services.http.sse_writer import StepWriter


class ChatTurn(msgspec.Struct):
    """A translated request on its way: the chat body, its GenerateRequest, and how its answer is read."""

    body: oa.ChatRequest
    wire: GenerateRequest
    reader: AnswerReader | None  # the model's own format (or its reasoning alone); None: TGI's tool_mode
    tool_mode: str | None  # TGI's: None plain text | "auto" text or a call | "call" a call (tools.tool_mode)
    keeps_special: bool = False  # the answer's text holds special tokens (tools.visible_text for TGI's mode)


def chat_turn(
    request: web.Request,
    ingress: int,
    chat: dict[str, Any],
    model_id: str,
    formats: ChatFormats,
    mode: str = "generate",
):
    """`chat` (an OpenAI chat body as a dict) → its ChatTurn, as /v1/chat/completions builds it; raises Failure.

    `top_k`, which OpenAI's chat lacks, is taken from the dict onto the parameters; the thinking budget is the
    chat's (`thinking_token_budget`, else `reasoning_effort`'s)."""
    top_k = chat.pop("top_k", None)
    try:
        body = msgspec.convert(chat, oa.ChatRequest)
        budget = oa.thinking_budget(body)
    except (msgspec.ValidationError, ValueError) as e:
        raise Failure(f"Invalid request: {e}", "validation") from None
    parameters = oa.chat_parameters(body, model_id)
    parameters.top_k = top_k
    wire = chat_wire(request, ingress, body, parameters, mode, budget)
    fmt = formats.of(wire.model)  # the format of the model the request is for
    mode = fmt.answer_mode(body, wire.tool_choice)
    if isinstance(mode, str):
        return ChatTurn(body, wire, None, mode, fmt.keeps_special)
    return ChatTurn(body, wire, mode, None)


def chat_wire(
    request: web.Request, ingress: int, body: oa.ChatRequest, parameters: Parameters, mode: str, budget: int | None
) -> GenerateRequest:
    """The GenerateRequest of a chat body: its messages and tools go to the tokenizer as sent, which renders them
    through the model's chat template, selects the tools and compiles the grammar that forces a call."""
    return bus_request(
        request,
        ingress,
        parameters,
        inputs="",
        add_special_tokens=False,  # the template holds the special tokens
        mode=mode,
        stream=body.stream,
        messages=body.messages,
        tools=body.tools,
        tool_choice=msgspec.to_builtins(body.tool_choice),
        tool_prompt=body.tool_prompt,
        chat_template_kwargs=oa.template_kwargs(body),
        documents=body.documents,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        thinking_budget=budget,
    )


class Call(msgspec.Struct):
    """One tool call read out of an answer: the function's name and its arguments as the model wrote them."""

    name: str
    arguments: str


class Answer(msgspec.Struct):
    reasoning: str  # "" when the model gave none (or has no reasoning format)
    text: str
    calls: list[Call]


def read_answer(rows: list, turn: ChatTurn) -> Answer:
    """A whole answer's rows → its reasoning, text and calls; raises Failure (tool_error) for a call that does not
    parse."""
    text = rows[-1].final.generated_text
    if turn.reader is not None:
        answer = turn.reader.read(text)
        return Answer(answer.reasoning or "", answer.content or "", [Call(c.name, c.arguments) for c in answer.calls])
    if turn.keeps_special:
        text = tools.visible_text(rows)
    mode = turn.tool_mode
    if mode == "call" or (mode == "auto" and tools.is_call(text)):
        calls = tools.parse_tool_call(text)
        return Answer("", "", [Call(c.function.name, c.function.arguments) for c in calls])
    return Answer("", text, [])


class AnswerStream:
    """A streamed answer's token texts → deltas: ("reasoning", piece), ("text", piece) or ("call", name, arguments
    piece); a call's first delta carries its name, the next ones None. The pieces add up to exactly
    `read_answer`'s."""

    def __init__(self, turn: ChatTurn) -> None:
        self.native = None if turn.reader is None else turn.reader.stream()
        self.tgi = None if turn.tool_mode is None else tools.ToolStream(auto=turn.tool_mode == "auto")

    def piece(self, row) -> str:
        """A token's text as the answer reads it (a special token's only where the format is written in them)."""
        if self.native is not None:
            return self.native.piece(row)
        return "" if row.special else row.text

    def push(self, piece: str, final: bool) -> list[tuple]:
        out = []
        if self.native is not None:
            for delta in self.native.push(piece, final):
                if delta[0] == "call":
                    out.append(("call", delta[1].name, delta[1].arguments))
                elif delta[1]:
                    out.append(("reasoning" if delta[0] == "reasoning" else "text", delta[1]))
            return out
        if self.tgi is None:
            return [("text", piece)] if piece else []
        for delta in self.tgi.push(piece, final):
            if delta[0] == "content":
                if delta[1]:
                    out.append(("text", delta[1]))
            else:
                out.append(("call", delta[1], delta[2]))
        return out


async def stream_turn(
    request: web.Request, turn: ChatTurn, events, ingress, permits, refusal
) -> tuple[web.StreamResponse, str]:
    """A turn's answer streamed as an API's `events` (its EventStream: start, push, end); the stream opens with the
    first token, so a Failure before it (template, tools, permits) is raised, to be answered with an HTTP status.
    One after it is written as `refusal(failure)`, the API's error event. Returns (the response, how it went:
    "ended", "failed" or "gone", the client having left); the caller ends the response unless it is gone."""
    http = None
    answer = AnswerStream(turn)
    try:
        with permits.hold():
            async with contextlib.aclosing(ingress.generate(turn.wire)) as rows:
                async for row in rows:
                    if http is None:
                        http = await open_stream(request, turn.body.characters)
                        writer = StepWriter(http)
                        await http.write(b"".join(events.start()))
                    final = row.final is not None
                    out = [e for d in answer.push(answer.piece(row), final) for e in events.push(d)]
                    if final:
                        out += events.end(row.final)
                    # a step's events in one write (services/http/sse_writer.py)
                    await writer.add_all(out, not final and ingress.ready(turn.wire.request_id))
    except Failure as e:
        if http is None:
            raise
        await writer.flush()
        await http.write(refusal(e))
        return http, "failed"
    except ConnectionResetError:  # the client went away; closing the rows above aborted the request
        return http or web.Response(), "gone"
    return http, "ended"
