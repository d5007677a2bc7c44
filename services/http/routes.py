"""TGI's routes: /generate, /generate_stream, POST / (compat), /health, /info, /metrics."""

from __future__ import annotations

import contextlib
import time
import uuid

import orjson
from aiohttp import web

from libs.protocol.messages import GenerateRequest
from libs.runtime.settings import Settings
from services.http import schemas
from services.http.ingress import Failure, Ingress

VERSION = "3.3.6-dev0"  # the TGI API version we implement


def error_response(status: int, message: str, error_type: str) -> web.Response:
    return web.json_response({"error": message, "error_type": error_type}, status=status, dumps=_dumps)


def _dumps(obj) -> str:
    return orjson.dumps(obj).decode()


class Routes:
    def __init__(self, settings: Settings, ingress: Ingress):
        self.settings = settings
        self.ingress = ingress
        self.in_flight = 0

    def install(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/generate_stream", self.generate_stream)
        app.router.add_post("/", self.compat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/info", self.info)
        app.router.add_get("/metrics", self.metrics)

    # ---- helpers --------------------------------------------------------------------------
    async def _read(self, request: web.Request) -> tuple[schemas.GenerateBody, GenerateRequest]:
        body = schemas.parse_body(await request.read(), schemas.GenerateBody)
        wire = GenerateRequest(
            request_id=uuid.uuid4().hex,
            ingress=self.ingress.index,
            inputs=body.inputs,
            parameters=body.wire_parameters(),
            received_at=time.time(),
        )
        return body, wire

    @contextlib.contextmanager
    def _permit(self):
        """TGI's semaphore: no waiting, an immediate 429 when full."""
        if self.in_flight >= self.settings.max_concurrent_requests:
            raise Failure("Model is overloaded", "overloaded")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    # ---- generation -----------------------------------------------------------------------
    async def generate(self, request: web.Request, compat: bool = False) -> web.StreamResponse:
        try:
            body, wire = await self._read(request)
        except schemas.BodyError as e:
            return error_response(e.status, str(e), "validation")
        # return_full_text null: false on /generate, true on POST / (TGI's compat default for a
        # text-generation model)
        full = wire.parameters.return_full_text
        full = compat if full is None else full
        if compat and body.stream:
            return await self._stream(request, body, wire, full)
        try:
            with self._permit():
                async with contextlib.aclosing(self.ingress.generate(wire)) as rows:
                    collected = [row async for row in rows]
        except Failure as e:
            return error_response(e.status, e.message, e.error_type)
        out = schemas.generate_response(body.inputs, wire.parameters, collected, full)
        return web.json_response([out] if compat else out, dumps=_dumps)

    async def compat(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, compat=True)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        try:
            body, wire = await self._read(request)
        except schemas.BodyError as e:
            return error_response(e.status, str(e), "validation")
        return await self._stream(request, body, wire, bool(wire.parameters.return_full_text))

    async def _stream(self, request, body, wire, full: bool) -> web.StreamResponse:
        """SSE; TGI answers 200 and reports every error in-stream."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        try:
            with self._permit():
                async with contextlib.aclosing(self.ingress.generate(wire)) as rows:
                    async for row in rows:
                        event = schemas.stream_event(row, body.inputs, wire.parameters, full)
                        await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        except Failure as e:
            await response.write(b"data: " + orjson.dumps(e.body()) + b"\n\n")
        except ConnectionResetError:  # the client went away; closing the rows above aborted the request
            return response
        await response.write_eof()
        return response

    # ---- info -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.ingress.healthy():
            return web.Response(status=200)
        return error_response(503, "unhealthy", "healthcheck")

    async def info(self, request: web.Request) -> web.Response:
        s = self.settings
        return web.json_response(
            {
                "model_id": s.model_id,
                "model_sha": s.model_sha or None,
                "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": s.max_concurrent_requests,
                "max_best_of": s.max_best_of,
                "max_stop_sequences": s.max_stop_sequences,
                "max_input_tokens": s.max_input_tokens,
                "max_total_tokens": s.max_total_tokens,
                "validation_workers": s.validation_workers,
                "max_client_batch_size": s.max_client_batch_size,
                "router": "switchyard",
                "version": VERSION,
                "sha": None,
                "docker_label": None,
            },
            dumps=_dumps,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        """Counters each process reports in its heartbeat (the full TGI metric set is its own issue)."""
        lines = []
        for role in ("router", "tokenizer", "scheduler", "detokenizer", "http"):
            for hb in self.ingress.liveness.alive(role):
                labels = f'role="{role}",index="{hb.index}"'
                lines.append(f"switchyard_process_up{{{labels}}} 1")
                for name, value in sorted(hb.counters.items()):
                    lines.append(f'switchyard_{role}_{name}_total{{index="{hb.index}"}} {value}')
                if role == "scheduler":
                    lines.append(f'switchyard_kv_blocks_free{{replica="{hb.index}"}} {hb.free_blocks}')
                    lines.append(f'switchyard_kv_blocks_total{{replica="{hb.index}"}} {hb.total_blocks}')
                    lines.append(f'switchyard_queue_size{{replica="{hb.index}"}} {hb.queue}')
                    lines.append(f'switchyard_batch_current_size{{replica="{hb.index}"}} {hb.running}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
