"""The OpenAI shapes of our OpenAPI document (services.http.openapi), and the list of every type it describes.

The TGI shapes are the very structs the routes encode (services.http.schemas); the OpenAI routes build plain
dicts, so their shapes are described here from TGI's API, kept lenient where TGI's output varies (optional keys
are not `required`). Where a request body's part is already a struct the routes parse with (the content parts,
stream_options), that struct is used, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from services.http import openai_schemas as oa
from services.http import schemas

U32 = schemas.U32
U64 = schemas.U64


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    arguments: Any = None  # a JSON value, or a JSON string in responses


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str
    function: FunctionDefinition


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[oa.TextPart | oa.ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: dict[str, Any]


class ChatRequest(msgspec.Struct, kw_only=True):
    messages: list[Message]
    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None  # repetition_penalty = presence_penalty + 2 (TGI)
    logit_bias: list[float] | None = None
    logprobs: bool | None = None
    top_logprobs: U32 | None = None
    max_tokens: U32 | None = None
    max_completion_tokens: U32 | None = None
    n: U32 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: oa.StreamOptions | None = None
    seed: U64 | None = None
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    tools: list[Tool] | None = None
    tool_prompt: str | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: schemas.GrammarType | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[str]
    model: str | None = None
    max_tokens: U32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: U64 | None = None
    suffix: str | None = None  # refused, as TGI
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    echo: bool | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionTopLogprob(msgspec.Struct):
    token: str
    logprob: float | None


class ChatCompletionLogprob(msgspec.Struct):
    token: str
    logprob: float | None
    top_logprobs: list[ChatCompletionTopLogprob]


class ChatCompletionLogprobs(msgspec.Struct):
    content: list[ChatCompletionLogprob]


class OutputToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str
    function: FunctionDefinition


class OutputMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    tool_calls: list[OutputToolCall] | None = None


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: OutputMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    object: Literal["chat.completion"]
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None


class DeltaFunction(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str


class DeltaToolCall(msgspec.Struct, kw_only=True):
    index: int
    id: str
    type: str
    function: DeltaFunction


class ChatCompletionDelta(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatCompletionDelta
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    object: Literal["chat.completion.chunk"]
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class CompletionComplete(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None


class Completion(msgspec.Struct, kw_only=True):
    """A whole completion, and the last event of a completion stream (TGI's CompletionFinal)."""

    object: Literal["text_completion"]
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionComplete]
    usage: Usage | None = None


class ChatTokenizeResponse(msgspec.Struct):
    tokenize_response: list[schemas.SimpleToken]
    templated_text: str


class OpenAIErrorBody(msgspec.Struct):
    message: str
    http_status_code: int


class OpenAIStreamError(msgspec.Struct):
    """An error inside an OpenAI stream; `data: [DONE]` follows."""

    error: OpenAIErrorBody


TYPES = (
    schemas.GenerateRequest,
    schemas.CompatGenerateRequest,
    schemas.GenerateResponse,
    schemas.StreamResponse,
    schemas.ErrorResponse,
    schemas.SimpleToken,
    schemas.Info,
    schemas.ModelsInfo,
    ChatRequest,
    CompletionRequest,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ChatTokenizeResponse,
    OpenAIStreamError,
)
