"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request is translated (translate.py) into the chat body of the internal chat path and generated as
/v1/chat/completions would; the answer's text and tool calls become content blocks (events.py). Every error is
Anthropic's `{"type": "error", "error": {type, message}}` with its HTTP status; once a stream has begun, an
`error` event.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from libs.runtime.settings import Settings
from services.http.anthropic import translate
from services.http.anthropic.events import EventStream, error_event, new_message, stop_reason, whole_content
from services.http.anthropic.schemas import (
    CountTokensRequest,
    ErrorBody,
    ErrorDetail,
    MessagesRequest,
    MessageUsage,
    TokensCount,
)
from services.http.chat_formats import ChatFormats
from services.http.chat_path import chat_turn, read_answer, stream_turn
from services.http.errors import Failure
from services.http.generation import Permits, collect
from services.http.models import check_model
from services.http.responses import json_response
from services.http.tgi.schemas import parse_body
from services.http.timing import Timing

# Anthropic's error type for each status (its documented errors); another 4xx is invalid_request_error
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    424: "api_error",  # TGI's failure during generation: the server's, not the request's
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_response(e: Failure) -> web.Response:
    body = ErrorBody(ErrorDetail(error_type(e.status), e.message))
    return web.Response(body=msgspec.json.encode(body), status=e.status, content_type="application/json")


class AnthropicRoutes:
    def __init__(self, settings: Settings, ingress, permits: Permits):
        self.settings = settings
        self.ingress = ingress
        self.permits = permits
        self.formats = ChatFormats(settings)  # each served model's tool-call and reasoning formats

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    def _turn(self, request: web.Request, body: CountTokensRequest, mode: str = "generate"):
        check_model(body.model, self.settings)
        chat = translate.chat_body(body)
        return chat_turn(request, self.ingress.index, chat, self.settings.model_id, self.formats, mode)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), MessagesRequest)
            turn = self._turn(request, body)
        except Failure as e:
            return error_response(e)
        stops = body.stop_sequences or []
        message = new_message(body.model)
        if body.stream:
            return await self._stream(request, turn, EventStream(message, stops))
        try:
            with self.permits.hold():
                rows = await collect(self.ingress, turn.wire, Timing(start=time.monotonic()))
            final = rows[-1].final
            answer = read_answer(rows, turn)
            message.content = whole_content(answer)
        except Failure as e:
            return error_response(e)
        message.stop_reason, message.stop_sequence = stop_reason(final, bool(answer.calls), stops)
        message.usage = MessageUsage(final.input_length, final.generated_tokens)
        return json_response(message)

    async def _stream(self, request, turn, events: EventStream) -> web.StreamResponse:
        def refusal(e: Failure) -> bytes:
            return error_event(error_type(e.status), e.message)

        try:
            http, outcome = await stream_turn(request, turn, events, self.ingress, self.permits, refusal)
        except Failure as e:
            return error_response(e)
        if outcome != "gone":
            await http.write_eof()
        return http

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's token count: the template rendered by the tokenizer, no generation (no permit)."""
        try:
            body = parse_body(await request.read(), CountTokensRequest)
            turn = self._turn(request, body, mode="tokenize")
            result = await self.ingress.tokenize(turn.wire)
        except Failure as e:
            return error_response(e)
        return json_response(TokensCount(len(result.ids)))
