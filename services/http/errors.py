"""Every error a client can see, in one place: `Failure`, the HTTP status TGI gives each error_type, TGI's
error body, and OpenAI's in-stream error event.

Whoever finds an error raises a Failure: the body parser, the permits, the OpenAI checks, the ingress (from a
RequestError on the bus, or its own watchdog). A route answers it with `error_response`: the status and TGI's
`{"error", "error_type"}` body; once an SSE stream has begun it is an event of the stream instead (TGI's routes:
the same body; OpenAI's: `OpenAIStreamError`, then `data: [DONE]`).

The routes of the two APIs and the middlewares have always written that body with different bytes, and each
keeps its own: TGI's routes send `application/json; charset=utf-8`, OpenAI's routes `application/json`, the
middlewares Python's json spacing (`{"error": "…", "error_type": "…"}`, non-ASCII escaped).
"""

from __future__ import annotations

import json

import msgspec
from aiohttp import web

LOST = "Request failed during generation: Server error: the request was lost in a restart"
DEPTH = "Failed to parse the request body as JSON: recursion limit exceeded"
# TGI's status for each error_type (its InferError); any other error_type is a 500
ERROR_STATUS = {
    "validation": 422,
    "template_error": 422,
    "missing_template_variable": 422,
    "tool_error": 422,
    "overloaded": 429,
    "generation": 424,
    "incomplete_generation": 500,
    "unavailable": 503,
}


class Failure(Exception):
    """A request ended in an error, in TGI's shape; `status` is given where the error_type alone does not say it
    (a malformed body's 400, the handlers' own refusals)."""

    def __init__(self, message: str, error_type: str, status: int | None = None):
        super().__init__(message)
        self.message, self.error_type = message, error_type
        self.status = status if status is not None else ERROR_STATUS.get(error_type, 500)


class OpenAIFailure(Failure):
    """A refusal OpenAI's routes answer in OpenAI's own shape, `{"error": {message, type, param, code}}`, because
    OpenAI's clients read its code (an unknown `model`: 404, invalid_request_error, model_not_found)."""

    def __init__(self, message: str, status: int, *, kind: str, code: str, param: str | None = None):
        super().__init__(message, kind, status)
        self.kind, self.code, self.param = kind, code, param


class ErrorResponse(msgspec.Struct):
    """TGI's error body."""

    error: str
    error_type: str


class OpenAIErrorBody(msgspec.Struct):
    message: str
    http_status_code: int


class OpenAIStreamError(msgspec.Struct):
    """An error inside an OpenAI stream; `data: [DONE]` follows."""

    error: OpenAIErrorBody


def error_body(e: Failure) -> ErrorResponse:
    return ErrorResponse(e.message, e.error_type)


def openai_stream_error(e: Failure) -> OpenAIStreamError:
    """TGI's `into_openai_event` says 422 whatever the error (kept: clients of TGI may match on it)."""
    return OpenAIStreamError(OpenAIErrorBody(e.message, 422))


def error_response(e: Failure, *, charset: str | None = "utf-8") -> web.Response:
    """A route's answer to `e`; OpenAI's routes pass charset=None (see the module's note)."""
    body = msgspec.json.encode(error_body(e))
    return web.Response(body=body, status=e.status, content_type="application/json", charset=charset)


def openai_error_response(e: OpenAIFailure) -> web.Response:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    return web.Response(body=msgspec.json.encode(body), status=e.status, content_type="application/json")


def layer_error_response(status: int, message: str, error_type: str) -> web.Response:
    """A middleware's answer: TGI's body in Python's json spacing (see the module's note)."""
    body = json.dumps(msgspec.to_builtins(ErrorResponse(message, error_type))).encode()
    return web.Response(body=body, status=status, content_type="application/json", charset="utf-8")
