"""The Messages API's bodies, as the `anthropic` SDK and Claude Code send and read them (anthropic/types):
the request, the Message with its content blocks, usage, the token count, and Anthropic's error shape. Fields
the server does not act on are accepted; unknown keys are ignored."""

from __future__ import annotations

from typing import Any

import msgspec

from services.http.tgi.schemas import U32


# ---- requests ---------------------------------------------------------------------------------
class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[dict[str, Any]]  # {role: user | assistant, content: text or blocks}
    system: str | list[dict[str, Any]] | None = None  # a text, or text blocks
    tools: list[dict[str, Any]] | None = None  # {name, description, input_schema}
    tool_choice: dict[str, Any] | None = None  # {type: auto | any | tool | none, name}
    thinking: dict[str, Any] | None = None  # {type: enabled, budget_tokens} | {type: disabled}
    output_config: dict[str, Any] | None = None  # {effort: low … max, format: {type: json_schema, schema}}
    tool_prompt: str | None = None  # not Anthropic's: TGI's tool prompt, as on /v1/chat/completions


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: U32
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: U32 | None = None
    metadata: dict[str, Any] | None = None


# ---- responses --------------------------------------------------------------------------------
class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any] | msgspec.Raw  # an answer's: the arguments' JSON text as written (events.tool_input)


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # services.http.anthropic.signature ("" only on a streamed block's start)


ContentBlock = TextBlock | ToolUseBlock | ThinkingBlock


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: str | None  # end_turn | max_tokens | stop_sequence | tool_use (None until the end of a stream)
    stop_sequence: str | None = None
    usage: MessageUsage


class TokensCount(msgspec.Struct):
    input_tokens: int


# ---- errors -----------------------------------------------------------------------------------
class ErrorDetail(msgspec.Struct):
    type: str  # invalid_request_error | authentication_error | not_found_error | rate_limit_error | …
    message: str


class ErrorBody(msgspec.Struct):
    """Anthropic's error, as a body and as a stream's `error` event."""

    error: ErrorDetail
    type: str = "error"
