"""The Responses API's bodies: the request as the openai SDK's `client.responses.create` and Codex send it, and
the Response object with its output items and usage, in the shapes of the openai SDK's types
(openai/types/responses). Fields the server does not act on are accepted and echoed, as OpenAI's own server
echoes them; unknown keys are ignored."""

from __future__ import annotations

from typing import Any

import msgspec

from services.http.tgi.schemas import U32, U64


# ---- request ----------------------------------------------------------------------------------
class TextConfig(msgspec.Struct):
    format: dict[str, Any] | None = None  # {type: text} | {type: json_object} | {type: json_schema, name, schema}


class ReasoningConfig(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]  # a text, or items: messages, function_call, function_call_output, reasoning
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # flat function tools: {type: function, name, description, parameters}
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {type: function, name}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: U32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: U64 | None = None  # not OpenAI's; as on /v1/chat/completions
    tool_prompt: str | None = None  # not OpenAI's: TGI's tool prompt, as on /v1/chat/completions
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None


# ---- response ---------------------------------------------------------------------------------
class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class ResponseOutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    role: str = "assistant"
    status: str = "completed"  # in_progress while streaming


class FunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: str = "completed"


OutputItem = ResponseOutputMessage | FunctionCall | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str  # max_output_tokens


class ResponseError(msgspec.Struct):
    code: str
    message: str


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str  # in_progress | completed | incomplete | failed
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = {}
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None

    @property
    def output_text(self) -> str:
        return "".join(p.text for item in self.output if isinstance(item, ResponseOutputMessage) for p in item.content)


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


# ---- errors -----------------------------------------------------------------------------------
class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(msgspec.Struct):
    """OpenAI's error body, which the SDK raises as BadRequestError, NotFoundError, … by status."""

    error: OpenAIErrorDetail
