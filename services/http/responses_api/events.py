"""A Response's output, built whole or streamed as the Responses API's events, in their documented order:

    response.created, response.in_progress,
    per output item: response.output_item.added,
        a message:  response.content_part.added, response.output_text.delta…, response.output_text.done,
                    response.content_part.done
        a call:     response.function_call_arguments.delta…, response.function_call_arguments.done
    response.output_item.done, and last response.completed (response.incomplete when max_output_tokens cut it).

Every event carries a sequence_number, counted from 0, and goes out as `event: <type>` + `data: <json>`. The
items streamed and the items of the final response are the same, ids included (the SDK's stream helper checks).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from libs.protocol.messages import FinalInfo
from services.http.chat_path import Answer
from services.http.responses_api.schemas import (
    FunctionCall,
    IncompleteDetails,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseOutputMessage,
    ResponseUsage,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvent(msgspec.Struct):
    type: str  # response.created | .in_progress | .completed | .incomplete | .failed
    response: Response
    sequence_number: int = 0


class OutputItemEvent(msgspec.Struct):
    type: str  # response.output_item.added | .done
    output_index: int
    item: OutputItem
    sequence_number: int = 0


class ContentPartEvent(msgspec.Struct):
    type: str  # response.content_part.added | .done
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int = 0


class TextDeltaEvent(msgspec.Struct):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    type: str = "response.output_text.delta"
    logprobs: list[Any] = []
    sequence_number: int = 0


class TextDoneEvent(msgspec.Struct):
    item_id: str
    output_index: int
    content_index: int
    text: str
    type: str = "response.output_text.done"
    logprobs: list[Any] = []
    sequence_number: int = 0


class ReasoningDeltaEvent(msgspec.Struct):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    type: str = "response.reasoning_text.delta"
    sequence_number: int = 0


class ReasoningDoneEvent(msgspec.Struct):
    item_id: str
    output_index: int
    content_index: int
    text: str
    type: str = "response.reasoning_text.done"
    sequence_number: int = 0


class ArgumentsDeltaEvent(msgspec.Struct):
    item_id: str
    output_index: int
    delta: str
    type: str = "response.function_call_arguments.delta"
    sequence_number: int = 0


class ArgumentsDoneEvent(msgspec.Struct):
    item_id: str
    output_index: int
    name: str
    arguments: str
    type: str = "response.function_call_arguments.done"
    sequence_number: int = 0


class ErrorEvent(msgspec.Struct):
    """An error after the stream began (its HTTP status was already sent)."""

    code: str
    message: str
    param: str | None = None
    type: str = "error"
    sequence_number: int = 0


def finish(response: Response, final: FinalInfo) -> None:
    """Status, usage and incomplete_details of a finished response."""
    response.usage = ResponseUsage(
        final.input_length, final.generated_tokens, final.input_length + final.generated_tokens
    )
    if final.finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails("max_output_tokens")
    else:
        response.status = "completed"


def whole_output(answer: Answer) -> list[OutputItem]:
    """A non-streamed answer's items: its reasoning (when any), its message (when it has text, or nothing else
    but reasoning), then its calls."""
    items: list[OutputItem] = []
    if answer.reasoning:
        items.append(ReasoningItem(new_id("rs"), content=[ReasoningText(answer.reasoning)]))
    if answer.text or not answer.calls:
        items.append(ResponseOutputMessage(new_id("msg"), [OutputText(answer.text)]))
    items += [FunctionCall(new_id("fc"), new_id("call"), c.name, c.arguments) for c in answer.calls]
    return items


class EventStream:
    """The events of one streamed response: deltas from chat_path.AnswerStream in, SSE bytes out."""

    def __init__(self, response: Response) -> None:
        self.response = response  # the snapshot: status in_progress, output filled as items complete
        self.seq = 0
        self.open: ResponseOutputMessage | FunctionCall | ReasoningItem | None = None  # the item being streamed

    def _event(self, event) -> bytes:
        event.sequence_number = self.seq
        self.seq += 1
        return b"event: " + event.type.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"

    @property
    def _index(self) -> int:
        return len(self.response.output)

    def start(self) -> list[bytes]:
        return [
            self._event(ResponseEvent("response.created", self.response)),
            self._event(ResponseEvent("response.in_progress", self.response)),
        ]

    def push(self, delta: tuple) -> list[bytes]:
        out: list[bytes] = []
        if delta[0] == "reasoning":
            if not isinstance(self.open, ReasoningItem):
                out += self.close()
                self.open = ReasoningItem(new_id("rs"), status="in_progress")
                out.append(self._event(OutputItemEvent("response.output_item.added", self._index, self.open)))
                self.open.content.append(ReasoningText(""))
            self.open.content[0].text += delta[1]
            out.append(self._event(ReasoningDeltaEvent(self.open.id, self._index, 0, delta[1])))
            return out
        if delta[0] == "text":
            if not isinstance(self.open, ResponseOutputMessage):
                out += self.close()
                out += self._open_message()
            self.open.content[0].text += delta[1]
            out.append(self._event(TextDeltaEvent(self.open.id, self._index, 0, delta[1])))
            return out
        _, name, piece = delta
        if name is not None:  # a new call
            out += self.close()
            self.open = FunctionCall(new_id("fc"), new_id("call"), name, "", status="in_progress")
            out.append(self._event(OutputItemEvent("response.output_item.added", self._index, self.open)))
        if piece:
            self.open.arguments += piece
            out.append(self._event(ArgumentsDeltaEvent(self.open.id, self._index, piece)))
        return out

    def _open_message(self) -> list[bytes]:
        self.open = ResponseOutputMessage(new_id("msg"), [], status="in_progress")
        added = self._event(OutputItemEvent("response.output_item.added", self._index, self.open))
        self.open.content.append(OutputText(""))
        part = self._event(
            ContentPartEvent("response.content_part.added", self.open.id, self._index, 0, OutputText(""))
        )
        return [added, part]

    def close(self) -> list[bytes]:
        """The done events of the open item, which joins the response's output."""
        item, index, out = self.open, self._index, []
        if item is None:
            return out
        item.status = "completed"
        if isinstance(item, ResponseOutputMessage):
            text = item.content[0].text
            out.append(self._event(TextDoneEvent(item.id, index, 0, text)))
            out.append(self._event(ContentPartEvent("response.content_part.done", item.id, index, 0, item.content[0])))
        elif isinstance(item, ReasoningItem):
            out.append(self._event(ReasoningDoneEvent(item.id, index, 0, item.content[0].text)))
        else:
            out.append(self._event(ArgumentsDoneEvent(item.id, index, item.name, item.arguments)))
        out.append(self._event(OutputItemEvent("response.output_item.done", index, item)))
        self.response.output.append(item)
        self.open = None
        return out

    def end(self, final: FinalInfo) -> list[bytes]:
        """The closing events: the open item's (an empty message when nothing was output), then the response's."""
        out = []
        if not any(isinstance(i, ResponseOutputMessage | FunctionCall) for i in [*self.response.output, self.open]):
            out += self.close()
            out += self._open_message()
        out += self.close()
        finish(self.response, final)
        kind = "response.completed" if self.response.status == "completed" else "response.incomplete"
        out.append(self._event(ResponseEvent(kind, self.response)))
        return out

    def error(self, code: str, message: str) -> list[bytes]:
        return [self._event(ErrorEvent(code, message))]
