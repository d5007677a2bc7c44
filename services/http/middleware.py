"""What TGI's router layers do around every route: CORS, the API key, the payload limit, and the
x-* response headers of the generation routes.

Choices:
- CORS: TGI's CorsLayer allows any origin when --cors-allow-origin is not given, so do we
  (`access-control-allow-origin: *`); with a list, a listed request Origin is echoed back and other
  origins get no CORS headers. Methods GET, POST; header content-type. A preflight (OPTIONS with
  Access-Control-Request-Method) is answered here, before the API key, as the outer CorsLayer does.
- API key: a bare 401 on TGI's protected routes only; both sides lowercased (TGI compares them
  case-insensitively), compared in constant time.
- Payload limit: a body over --payload-limit is a 413 with TGI's message, in TGI's JSON error shape
  (TGI sends it as plain text, which its own client cannot parse).
- x-compute-type: env COMPUTE_TYPE as TGI; without it "gpu+optimized" (TGI's default) when an
  NVIDIA device is present, else "cpu".
- Errors no handler expected (e.g. JSON nested deeper than the decoder recurses) still answer in
  TGI's JSON error shape, never aiohttp's plain-text 500: nesting is TGI's 400 (serde_json's
  recursion limit), a body the bus cannot carry (an int past 64 bits inside chat messages or tools,
  which are passed on as sent) a 422, anything else a logged 500 `internal`.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import time

from aiohttp import web

from libs.protocol import ProtocolError
from libs.protocol.messages import FinalInfo
from libs.runtime.logs import escape
from libs.runtime.settings import Settings
from services.http.ingress import Timing

PAYLOAD_MESSAGE = "Failed to buffer the request body: length limit exceeded"
DEPTH_MESSAGE = "Failed to parse the request body as JSON: recursion limit exceeded"
log = logging.getLogger("switchyard.http")
# TGI's "base routes": the only ones behind --api-key
PROTECTED = {
    ("POST", "/"),
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/vertex"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
}
CORS_METHODS = "GET,POST"
CORS_HEADERS = "content-type"
CORS_VARY = "origin, access-control-request-method, access-control-request-headers"


def compute_type() -> str:
    if os.environ.get("COMPUTE_TYPE"):
        return os.environ["COMPUTE_TYPE"]
    return "gpu+optimized" if os.path.exists("/dev/nvidia0") else "cpu"


def _error(status: int, message: str, error_type: str) -> web.Response:
    return web.json_response({"error": message, "error_type": error_type}, status=status)


def middlewares(settings: Settings) -> list:
    """The middlewares of the app, outermost first."""
    origins = {o.strip() for o in settings.cors_allow_origin.split(",") if o.strip()}
    expected = ("bearer " + settings.api_key).lower().encode() if settings.api_key else None

    def allow_origin(request: web.Request) -> str | None:
        if not origins:
            return "*"
        origin = request.headers.get("Origin")
        return origin if origin in origins else None

    @web.middleware
    async def cors(request: web.Request, handler):
        allowed = allow_origin(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = web.Response(status=200)
            if allowed is not None:
                response.headers["Access-Control-Allow-Origin"] = allowed
                response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
                response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
            response.headers["Vary"] = CORS_VARY
            return response
        try:
            response = await handler(request)
        except web.HTTPException as e:  # 404/405 and friends get the headers too
            response = e
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
        if origins:
            response.headers["Vary"] = CORS_VARY
        if isinstance(response, web.HTTPException):
            raise response
        return response

    @web.middleware
    async def api_key(request: web.Request, handler):
        if expected is not None and (request.method, request.path) in PROTECTED:
            given = request.headers.get("Authorization", "").lower().encode()
            if not hmac.compare_digest(given, expected):
                return web.Response(status=401)
        return await handler(request)

    @web.middleware
    async def payload_limit(request: web.Request, handler):
        if request.content_length is not None and request.content_length > settings.payload_limit:
            return _error(413, PAYLOAD_MESSAGE, "payload_too_large")
        try:  # a chunked body has no length up front: aiohttp stops reading at client_max_size
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, PAYLOAD_MESSAGE, "payload_too_large")

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except ConnectionResetError:  # the client left (e.g. while a stream's headers were sent): no one to answer
            return web.Response(status=499)  # aiohttp's write of it fails quietly on the closed transport
        except Exception as e:
            if _response_started(request):  # mid-stream: nothing left to answer with; aiohttp closes it
                raise
            if isinstance(e, RecursionError):
                return _error(400, DEPTH_MESSAGE, "validation")
            if isinstance(e, ProtocolError):  # the body holds what the bus cannot carry, e.g. an int past 64 bits
                return _error(422, f"Failed to deserialize the JSON body into the target type: {e}", "validation")
            log.exception("unexpected error on %s %s", request.method, escape(request.path))
            return _error(500, "Internal server error", "internal")

    return [cors, api_key, payload_limit, errors]


def _response_started(request: web.Request) -> bool:
    """Whether a (streamed) response already sent or queued its headers (aiohttp keeps this private)."""
    writer = request.writer
    return bool(getattr(writer, "_headers_written", False) or getattr(writer, "_headers_buf", None))


def stream_headers(inputs: str) -> dict[str, str]:
    """TGI's headers on the SSE routes."""
    return {
        "x-compute-type": compute_type(),
        "x-compute-characters": str(len(inputs)),
        "X-Accel-Buffering": "no",
    }


def timing_headers(timing: Timing, inputs: str, final: FinalInfo, end: float | None = None) -> dict[str, str]:
    """TGI's headers on a finished non-streamed request.

    TGI splits its total time at the moment the request was queued (validation before) and the
    moment its batch started (queue before, inference after). The http process sees neither, so:
    validation = read → Accepted (tokenizer + router placement), queue = Accepted → first token
    row (queueing AND the prefill), inference = first token row → last one (the decode steps).
    """
    end = time.monotonic() if end is None else end
    accepted = timing.accepted or end
    first = timing.first or accepted
    last = timing.last or end
    inference = max(last - first, 0.0)
    tokens = max(final.generated_tokens, 1)

    def ms(seconds: float) -> str:
        return str(math.floor(max(seconds, 0.0) * 1000))

    return {
        "x-compute-type": compute_type(),
        "x-compute-time": repr(max(end - timing.start, 0.0)),
        "x-compute-characters": str(len(inputs)),
        "x-total-time": ms(end - timing.start),
        "x-validation-time": ms(accepted - timing.start),
        "x-queue-time": ms(first - accepted),
        "x-inference-time": ms(inference),
        "x-time-per-token": ms(inference / tokens),
        "x-prompt-tokens": str(final.input_length),
        "x-generated-tokens": str(final.generated_tokens),
    }
