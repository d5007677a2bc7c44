"""Graceful drain of one http process: after SIGTERM, readiness turns 503, new generation requests are refused
with a 503 in their API's own error shape, and the requests already running are counted until they finish or the
termination timeout passes.

`Drain.middleware` sits in front of every route: it counts generation requests in flight (a streamed one is in
flight until its handler returns, i.e. its final event is written) and, once `begin()` was called, answers
/health and new generation requests itself. It also answers `GET /livez`, 200 whenever the process serves HTTP,
draining or not: an orchestrator's liveness probe, which must not restart a pod that drains or whose model replica
is restarting (`/health`, `/ping` and `GET /` are TGI's readiness: 503 then). `wait_idle(timeout)` returns when
nothing is in flight or the timeout passed, and says which.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

MESSAGE = "the server is shutting down"
HEALTH_PATHS = frozenset({"/health", "/ping", "/"})  # GET / is TGI's health too
LIVENESS_PATH = "/livez"  # Kubernetes' name for it; TGI's /ping is its /health, so it cannot be this
TGI_PATHS = frozenset({"/generate", "/generate_stream", "/", "/invocations", "/vertex"})
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
ANTHROPIC_PATHS = frozenset({"/v1/messages"})
GENERATION_PATHS = TGI_PATHS | OPENAI_PATHS | ANTHROPIC_PATHS


def refusal(path: str) -> web.Response:
    """The 503 a request on `path` gets while draining, in the shape its API's clients parse."""
    if path in OPENAI_PATHS:
        body = {"error": {"message": MESSAGE, "type": "server_error", "param": None, "code": "service_unavailable"}}
    elif path in ANTHROPIC_PATHS:
        body = {"type": "error", "error": {"type": "overloaded_error", "message": MESSAGE}}
    else:
        body = {"error": MESSAGE, "error_type": "unavailable"}
    return web.Response(body=json.dumps(body).encode(), status=503, content_type="application/json")


class Drain:
    """Whether this process is draining, what is still in flight, and how many requests it refused."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.refused = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every request in flight finished within `timeout` seconds, False when some still run."""
        if self._idle.is_set():  # wait_for with a zero timeout would time out before looking
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def metrics_text(self) -> str:
        """Prometheus lines: the draining gauge and the count of requests refused while draining."""
        return (
            "# TYPE switchyard_draining gauge\n"
            f"switchyard_draining {int(self.draining)}\n"
            "# TYPE switchyard_drain_refused_total counter\n"
            f"switchyard_drain_refused_total {self.refused}\n"
        )

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        path = request.path
        if request.method == "GET" and path == "/metrics":  # the drain's own lines after the others
            response = await handler(request)
            if isinstance(response, web.Response) and isinstance(response.body, bytes):
                response.body = response.body + self.metrics_text().encode()
            return response
        if request.method == "GET" and path == LIVENESS_PATH:
            return web.Response(status=200)
        if request.method == "GET" and path in HEALTH_PATHS and self.draining:
            return refusal(path)
        if request.method != "POST" or path not in GENERATION_PATHS:
            return await handler(request)
        if self.draining:
            self.refused += 1
            return refusal(path)
        self._enter()
        try:
            return await handler(request)
        finally:
            self._leave()
