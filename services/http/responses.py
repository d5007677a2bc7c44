"""How every route writes, whichever API: a JSON body, and Server-Sent Events.

Each body and event is a struct (or a list of them) of services.http.tgi.schemas, services.http.openai.responses
or services.http.errors, encoded by msgspec: the very struct the OpenAPI document describes.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from services.http.timing import stream_headers

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"  # the end of an OpenAI stream


def json_response(obj, headers: dict | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), headers=headers, content_type="application/json")


def sse(obj) -> bytes:
    """One SSE event: `data: ` with one space (every client probed accepts it, some need it), then compact JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def open_stream(request: web.Request, characters: str) -> web.StreamResponse:
    """An SSE response, its headers sent: TGI's, with x-compute-characters counting `characters`."""
    response = web.StreamResponse(headers={**SSE_HEADERS, **stream_headers(characters)})
    await response.prepare(request)
    return response
