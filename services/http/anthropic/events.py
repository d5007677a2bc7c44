"""A Message's content, built whole or streamed as the Messages API's events, in their documented order:

    message_start, ping,
    per content block: content_block_start, content_block_delta… (thinking_delta then one signature_delta |
        text_delta | input_json_delta), content_block_stop,
    message_delta (stop_reason, stop_sequence, usage), message_stop.

The prompt's token count is known once generation ends, so message_start says 0 input tokens and message_delta
carries the count (the SDK's accumulator takes it from there). A tool_use block's input streams as the arguments
text the model writes; its pieces add up to the JSON of the non-streamed block's input.

A thinking block's signature (services.http.anthropic.signature) is the same whole and streamed: the streamed
block's comes as its last delta, as Anthropic sends it.
"""

from __future__ import annotations

import json
import uuid

import msgspec

from libs.protocol.messages import FinalInfo
from services.http.anthropic.schemas import (
    ContentBlock,
    ErrorBody,
    ErrorDetail,
    Message,
    MessageUsage,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from services.http.anthropic.signature import sign
from services.http.chat_path import Answer, Call
from services.http.errors import Failure


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(final: FinalInfo, called: bool, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer. The text keeps a stop sequence it ended on (as TGI's
    generated_text); the one named is the last to occur in it."""
    if called:
        return "tool_use", None
    if final.finish_reason == "length":
        return "max_tokens", None
    if final.finish_reason == "stop_sequence":
        hits = [(final.generated_text.rfind(s), s) for s in stops if s in final.generated_text]
        return "stop_sequence", max(hits)[1] if hits else None
    return "end_turn", None


def tool_input(call: Call) -> msgspec.Raw:
    """A call's arguments as the block's input: checked to be a JSON object, then sent as the model wrote them
    (a number past 64 bits stays exact; the streamed input_json_delta pieces are the same text)."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        raise Failure(f"Tool error: Failed to parse generated arguments: {e}", "tool_error") from None
    if not isinstance(value, dict):
        raise Failure(f"Tool error: the arguments are not an object: {call.arguments!r}", "tool_error")
    return msgspec.Raw(call.arguments.encode())


def whole_content(answer: Answer) -> list[ContentBlock]:
    """A non-streamed answer's blocks: its thinking (when any), its text (when it has one, or no call), then its
    tool_use blocks."""
    blocks: list[ContentBlock] = [ThinkingBlock(answer.reasoning, sign(answer.reasoning))] if answer.reasoning else []
    if answer.text or not answer.calls:
        blocks.append(TextBlock(answer.text))
    return blocks + [ToolUseBlock(new_id("toolu"), c.name, tool_input(c)) for c in answer.calls]


# ---- stream events ----------------------------------------------------------------------------
class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class BlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class BlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class BlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct):
    output_tokens: int
    input_tokens: int


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


def event(name: str, body) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


class EventStream:
    """The events of one streamed message: deltas from chat_path.AnswerStream in, SSE bytes out."""

    def __init__(self, message: Message, stops: list[str]) -> None:
        self.message = message  # content empty, stop_reason None
        self.stops = stops
        self.index = -1  # the open block's index
        self.open: str | None = None  # "thinking" | "text" | "tool_use" | None
        self.texts = False  # whether a text or tool_use block was sent
        self.called = False
        self.thinking = ""  # the open thinking block's text, signed when it closes

    def start(self) -> list[bytes]:
        return [event("message_start", MessageStart(self.message)), event("ping", Ping())]

    def push(self, delta: tuple) -> list[bytes]:
        out: list[bytes] = []
        if delta[0] == "reasoning":
            if self.open != "thinking":
                out += self._close()
                out += self._open("thinking", ThinkingBlock(""))
                self.thinking = ""
            self.thinking += delta[1]
            out.append(event("content_block_delta", BlockDelta(self.index, ThinkingDelta(delta[1]))))
            return out
        self.texts = True
        if delta[0] == "text":
            if self.open != "text":
                out += self._close()
                out += self._open("text", TextBlock(""))
            out.append(event("content_block_delta", BlockDelta(self.index, TextDelta(delta[1]))))
            return out
        _, name, piece = delta
        if name is not None:
            out += self._close()
            out += self._open("tool_use", ToolUseBlock(new_id("toolu"), name, {}))
            self.called = True
        if piece:
            out.append(event("content_block_delta", BlockDelta(self.index, InputJsonDelta(piece))))
        return out

    def _open(self, kind: str, block: ContentBlock) -> list[bytes]:
        self.index += 1
        self.open = kind
        return [event("content_block_start", BlockStart(self.index, block))]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(event("content_block_delta", BlockDelta(self.index, SignatureDelta(sign(self.thinking)))))
        self.open = None
        return [*out, event("content_block_stop", BlockStop(self.index))]

    def end(self, final: FinalInfo) -> list[bytes]:
        out = []
        if not self.texts:  # no answer: one empty text block, as the non-streamed message has
            out += self._close()
            out += self._open("text", TextBlock(""))
        out += self._close()
        reason, sequence = stop_reason(final, self.called, self.stops)
        usage = DeltaUsage(final.generated_tokens, final.input_length)
        out.append(event("message_delta", MessageDelta(StopDelta(reason, sequence), usage)))
        out.append(event("message_stop", MessageStop()))
        return out


def new_message(model: str) -> Message:
    return Message(id=new_id("msg"), model=model, content=[], stop_reason=None, usage=MessageUsage(0, 0))


def error_event(kind: str, message: str) -> bytes:
    return event("error", ErrorBody(ErrorDetail(kind, message)))
