"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request is translated (translate.py) into the chat body of the internal chat path and generated as
/v1/chat/completions would; the answer's text and tool calls become output items (events.py). Errors are OpenAI's
`{"error": {message, type, param, code}}` with their HTTP status; once a stream has begun, an `error` event.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from libs.runtime.settings import Settings
from services.http.chat_formats import ChatFormats
from services.http.chat_path import chat_turn, read_answer, stream_turn
from services.http.errors import Failure, OpenAIFailure, openai_error_response
from services.http.generation import Permits, collect
from services.http.models import check_model
from services.http.responses import json_response
from services.http.responses_api import translate
from services.http.responses_api.events import EventStream, finish, new_id, whole_output
from services.http.responses_api.schemas import (
    DeletedResponse,
    OpenAIError,
    OpenAIErrorDetail,
    Response,
    ResponsesRequest,
)
from services.http.responses_api.store import ResponseStore
from services.http.tgi.schemas import parse_body
from services.http.timing import Timing


def error_response(e: Failure) -> web.Response:
    """`e` in OpenAI's error shape: a TGI-shaped Failure (the tokenizer's 422s, 429, …) keeps its status, its
    error_type as the code; type invalid_request_error for a 4xx, rate_limit_error, or server_error."""
    if isinstance(e, OpenAIFailure):
        return openai_error_response(e)
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    if e.status == 429:
        kind = "rate_limit_error"
    detail = OpenAIErrorDetail(e.message, kind, None, e.error_type)
    return web.Response(body=msgspec.json.encode(OpenAIError(detail)), status=e.status, content_type="application/json")


def not_found(response_id: str, param: str | None = None) -> OpenAIFailure:
    message = f"Response with id '{response_id}' not found."
    return OpenAIFailure(message, 404, kind="invalid_request_error", code="not_found", param=param)


class ResponsesRoutes:
    def __init__(self, settings: Settings, ingress, permits: Permits, store: ResponseStore | None = None):
        self.settings = settings
        self.ingress = ingress
        self.permits = permits
        self.store = store or ResponseStore()
        self.formats = ChatFormats(settings)  # each served model's tool-call and reasoning formats

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), ResponsesRequest)
            check_model(body.model, self.settings)
            history = []
            if body.previous_response_id is not None:
                stored = self.store.get(body.previous_response_id)
                if stored is None:
                    raise not_found(body.previous_response_id, "previous_response_id")
                history = stored.conversation
            chat = translate.chat_body(body, history)
            turn = chat_turn(request, self.ingress.index, chat, self.settings.model_id, self.formats)
            conversation = history + translate.input_messages(body.input)
        except Failure as e:
            return error_response(e)
        response = self._response(body)
        if body.stream:
            return await self._stream(request, body, turn, response, conversation)
        try:
            with self.permits.hold():
                rows = await collect(self.ingress, turn.wire, Timing(start=time.monotonic()))
            final = rows[-1].final
            answer = read_answer(rows, turn)
        except Failure as e:
            return error_response(e)
        response.output = whole_output(answer)
        finish(response, final)
        self._keep(body, response, conversation)
        return json_response(response)

    def _response(self, body: ResponsesRequest) -> Response:
        """The response as it starts: in progress, no output yet; the request's settings echoed."""
        model = body.model if body.model not in (None, "", "tgi") else self.settings.model_id
        return Response(
            id=new_id("resp"),
            created_at=int(time.time()),
            status="in_progress",
            model=model,
            output=[],
            parallel_tool_calls=body.parallel_tool_calls is not False,
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            tools=body.tools or [],
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            previous_response_id=body.previous_response_id,
            store=body.store,
            text={"format": (body.text.format if body.text is not None else None) or {"type": "text"}},
            reasoning=msgspec.to_builtins(body.reasoning) if body.reasoning is not None else None,
            metadata=body.metadata or {},
        )

    def _keep(self, body: ResponsesRequest, response: Response, conversation: list[dict]) -> None:
        if body.store:
            self.store.put(response, conversation + translate.output_messages(response.output))

    async def _stream(self, request, body: ResponsesRequest, turn, response: Response, conversation: list[dict]):
        events = EventStream(response)

        def refusal(e: Failure) -> bytes:
            return b"".join(events.error(e.error_type, e.message))

        try:
            http, outcome = await stream_turn(request, turn, events, self.ingress, self.permits, refusal)
        except Failure as e:
            return error_response(e)
        if outcome == "ended":
            self._keep(body, response, conversation)  # before the end: a next turn may name it at once
        if outcome != "gone":
            await http.write_eof()
        return http

    async def retrieve(self, request: web.Request) -> web.Response:
        stored = self.store.get(request.match_info["response_id"])
        if stored is None:
            return error_response(not_found(request.match_info["response_id"]))
        return json_response(stored.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            return error_response(not_found(response_id))
        return json_response(DeletedResponse(response_id))
