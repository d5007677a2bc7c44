"""What TGI's router layers do around every route: CORS, the API key, the payload limit, and a JSON answer
to any error no handler expected.

CORS as TGI's CorsLayer (any origin unless --cors-allow-origin lists some; a preflight answered before the API
key); the API key a bare 401 on TGI's protected routes only, compared case-insensitively in constant time; a body
over --payload-limit a 413 with TGI's message in TGI's JSON error shape; an error no handler expected still in
TGI's JSON error shape, never aiohttp's plain-text 500 (too deep a nesting 400, a body the bus cannot carry 422,
anything else a logged 500). docs/http.md tells why.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from libs.protocol import ProtocolError
from libs.runtime.logs import escape
from libs.runtime.settings import Settings
from services.http.errors import DEPTH, layer_error_response

PAYLOAD_MESSAGE = "Failed to buffer the request body: length limit exceeded"
log = logging.getLogger("switchyard.http")
# TGI's "base routes": the only ones behind --api-key
PROTECTED = {
    ("POST", "/"),
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/vertex"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
}
CORS_METHODS = "GET,POST"
CORS_HEADERS = "content-type"
CORS_VARY = "origin, access-control-request-method, access-control-request-headers"


def middlewares(settings: Settings) -> list:
    """The middlewares of the app, outermost first."""
    origins = {o.strip() for o in settings.cors_allow_origin.split(",") if o.strip()}
    expected = ("bearer " + settings.api_key).lower().encode() if settings.api_key else None
    # Anthropic's clients send the key bare in x-api-key; compared as the bearer form is
    expected_key = settings.api_key.lower().encode() if settings.api_key else None

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
        if expected is not None and _protected(request):
            given = request.headers.get("Authorization", "").lower().encode()
            key = request.headers.get("x-api-key", "").lower().encode()
            # both compared every time: which header was sent does not change the time taken
            bearer_ok = hmac.compare_digest(given, expected)
            key_ok = hmac.compare_digest(key, expected_key)
            if not (bearer_ok or key_ok):
                return web.Response(status=401)
        return await handler(request)

    @web.middleware
    async def payload_limit(request: web.Request, handler):
        if request.content_length is not None and request.content_length > settings.payload_limit:
            return layer_error_response(413, PAYLOAD_MESSAGE, "payload_too_large")
        try:  # a chunked body has no length up front: aiohttp stops reading at client_max_size
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return layer_error_response(413, PAYLOAD_MESSAGE, "payload_too_large")

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
                return layer_error_response(400, DEPTH, "validation")
            if isinstance(e, ProtocolError):  # the body holds what the bus cannot carry, e.g. an int past 64 bits
                return layer_error_response(
                    422, f"Failed to deserialize the JSON body into the target type: {e}", "validation"
                )
            log.exception("unexpected error on %s %s", request.method, escape(request.path))
            return layer_error_response(500, "Internal server error", "internal")

    return [cors, api_key, payload_limit, errors]


def _protected(request: web.Request) -> bool:
    """Whether the route is behind --api-key: its method and path template are listed in PROTECTED."""
    resource = request.match_info.route.resource
    return (request.method, resource.canonical if resource is not None else request.path) in PROTECTED


def _response_started(request: web.Request) -> bool:
    """Whether a (streamed) response already sent or queued its headers (aiohttp keeps this private)."""
    writer = request.writer
    return bool(getattr(writer, "_headers_written", False) or getattr(writer, "_headers_buf", None))
