"""TGI's routes: /generate, /generate_stream, POST / (compat), /invocations, /tokenize, /health (GET /,
/ping), /info, /v1/models, /metrics, /docs and /api-doc/openapi.json."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time

import orjson
from aiohttp import web

from libs.protocol.messages import GenerateRequest
from libs.runtime import metrics, model_store
from libs.runtime.settings import Settings
from services.http import lora, models, openapi
from services.http.errors import DEPTH, Failure, error_body, error_response
from services.http.generation import Permits, bus_request, collect
from services.http.ingress import Ingress
from services.http.openai import choices
from services.http.openai.routes import OpenAIRoutes
from services.http.responses import json_response, open_stream, sse
from services.http.sse_writer import StepWriter
from services.http.tgi import schemas as tgi
from services.http.tgi import vertex
from services.http.timing import Timing, timing_headers

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SAGEMAKER_MISMATCH = (
    "Failed to deserialize the JSON body into the target type: "
    "data did not match any variant of untagged enum SagemakerRequest"
)
SWAGGER_UI = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>Switchyard — API</title>
  <link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
  <script>
    window.ui = SwaggerUIBundle({url: "/api-doc/openapi.json", dom_id: "#swagger-ui"});
  </script>
</body>
</html>
"""


def local_metrics() -> str:
    """This process's registry alone, for an ingress without an aggregator (tests' stand-ins)."""
    return metrics.merge([metrics.exposition()])


class Routes:
    def __init__(self, settings: Settings, ingress: Ingress, permits: Permits, openai: OpenAIRoutes):
        self.settings = settings
        self.ingress = ingress
        self.permits = permits
        self.openai = openai  # /invocations hands chat and completion bodies to it
        self._openapi: bytes | None = None

    def install(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/generate_stream", self.generate_stream)
        app.router.add_post("/", self.compat)
        app.router.add_post("/invocations", self.invocations)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", functools.partial(vertex.detokenize, self))  # vLLM's
        app.router.add_post("/vertex", functools.partial(vertex.vertex, self))
        app.router.add_get("/health", self.health)
        app.router.add_get("/", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/info", self.info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/docs", self.docs)
        app.router.add_get("/api-doc/openapi.json", self.openapi)
        lora.install(app, self.settings, self.ingress)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter

    # ---- helpers --------------------------------------------------------------------------
    async def _read(self, request: web.Request, kind: type, stream: bool = False, mode: str = "generate"):
        """The body and its GenerateRequest; raises Failure."""
        try:
            body = tgi.parse_body(await request.read(), kind)
        except RecursionError:  # TGI's 400; the OpenAI routes leave it to the errors middleware
            raise Failure(DEPTH, "validation", 400) from None
        stream = stream or getattr(body, "stream", False)  # the compat body says it itself
        wire = bus_request(
            request, self.ingress.index, body.wire_parameters(), inputs=body.inputs, mode=mode, stream=stream
        )
        return body, wire

    async def _best_of(self, wire: GenerateRequest, n: int, timing: Timing):
        """N requests at once (TGI's generate_best_of); the first failure wins; the best mean logprob wins.
        The N are siblings of one group, as OpenAI's `n` choices: the scheduler prefills the prompt once and the
        others fork its blocks; only the first scores the prompt, and every sequence's details get its prefill.

        Returns (best rows, the other sequences' rows in their order)."""
        copies = choices.siblings(wire, n)
        with self.permits.hold(n):
            quiet = getattr(self.ingress, "quiet", None)
            if quiet is not None:  # TGI counts best_of as one request: the other sequences go unrecorded
                quiet.update(c.request_id for c in copies[1:])
            tasks = [
                asyncio.create_task(collect(self.ingress, c, timing if i == 0 else None)) for i, c in enumerate(copies)
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in tasks:
                    if task in done and task.exception() is not None:
                        raise task.exception()
                results = choices.share_prompt_details([task.result() for task in tasks], n)
            finally:  # a failure or a client gone: cancelling closes each stream, which aborts it
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        scores = [tgi.mean_logprob(rows) for rows in results]
        best = max(range(n), key=lambda i: (scores[i], -i))  # ties: the first, as TGI's strict `>`
        return results[best], [rows for i, rows in enumerate(results) if i != best]

    # ---- generation -----------------------------------------------------------------------
    async def generate(self, request: web.Request, compat: bool = False) -> web.StreamResponse:
        kind = tgi.CompatGenerateRequest if compat else tgi.GenerateRequest
        try:
            body, wire = await self._read(request, kind)
        except Failure as e:
            return error_response(e)
        params = wire.parameters
        # return_full_text null: false on /generate, true on POST / (TGI's compat default for a
        # text-generation model)
        full = compat if params.return_full_text is None else params.return_full_text
        if wire.stream:
            return await self._stream(request, wire, full)
        timing = Timing(start=time.monotonic())
        n = params.best_of or 1
        try:
            if 1 < n <= self.settings.max_best_of:
                rows, others = await self._best_of(wire, n, timing)
            else:  # a best_of over the limit goes alone: the tokenizer answers TGI's BestOf error
                with self.permits.hold():
                    rows, others = await collect(self.ingress, wire, timing), None
        except Failure as e:
            return error_response(e)
        out = tgi.generate_response(body.inputs, params, rows, full, others)
        headers = timing_headers(timing, body.inputs, rows[-1].final)
        return json_response([out] if compat else out, headers=headers)

    async def compat(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, compat=True)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        try:
            _, wire = await self._read(request, tgi.GenerateRequest, stream=True)
        except Failure as e:
            return error_response(e)
        return await self._stream(request, wire, bool(wire.parameters.return_full_text))

    async def _stream(self, request: web.Request, wire: GenerateRequest, full: bool) -> web.StreamResponse:
        """SSE; TGI answers 200 and reports every error in-stream."""
        response = await open_stream(request, wire.inputs)
        writer = StepWriter(response)
        try:
            with self.permits.hold():
                async with contextlib.aclosing(self.ingress.generate(wire)) as rows:
                    async for row in rows:
                        event = sse(tgi.stream_event(row, wire.inputs, wire.parameters, full))
                        await writer.add(event, row.final is None and self.ingress.ready(wire.request_id))
        except Failure as e:
            await writer.flush()
            await response.write(sse(error_body(e)))
        except ConnectionResetError:  # the client went away; closing the rows above aborted the request
            return response
        await response.write_eof()
        return response

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's untagged body: compat generate (`inputs`), else chat (`messages`), else completion."""
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return error_response(Failure(f"Failed to parse the request body as JSON: {e}", "validation", 400))
        if isinstance(data, dict):
            if "inputs" in data:
                return await self.compat(request)
            if "messages" in data:
                return await self.openai.chat(request)
            if "prompt" in data:
                return await self.openai.completions(request)
        return error_response(Failure(SAGEMAKER_MISMATCH, "validation"))

    async def tokenize(self, request: web.Request) -> web.Response:
        """TGI's [SimpleToken]: no permit, no parameter validation (the tokenizer only tokenizes)."""
        try:
            _, wire = await self._read(request, tgi.GenerateRequest, mode="tokenize")
            result = await self.ingress.tokenize(wire)
        except Failure as e:
            return error_response(e)
        return json_response(tgi.simple_tokens(result.text, result.ids, result.starts, result.stops))

    # ---- info -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.ingress.healthy():
            return web.Response(status=200)
        return error_response(Failure("unhealthy", "healthcheck", 503))

    def info_struct(self) -> tgi.Info:
        s = self.settings
        return tgi.Info(
            model_id=s.model_id,
            model_sha=s.model_sha or None,
            model_pipeline_tag="image-text-to-text" if self._takes_images() else "text-generation",
            max_concurrent_requests=s.max_concurrent_requests,
            max_best_of=s.max_best_of,
            max_stop_sequences=s.max_stop_sequences,
            max_input_tokens=s.max_input_tokens,
            max_total_tokens=s.max_total_tokens,
            validation_workers=s.validation_workers,
            max_client_batch_size=s.max_client_batch_size,
            router="switchyard",
            version=tgi.VERSION,
            sha=None,
            docker_label=os.environ.get("DOCKER_LABEL") or None,
            model_dtype=s.dtype,
            lora_adapters=lora.names(s),
            quantization=s.quantize or None,
            input_modalities=self._modalities(),
        )

    def _takes_images(self) -> bool:
        """Whether the served model is a vision-language model (its config names a vision tower)."""
        try:
            return bool(model_store.model_info(self.settings.model_path).get("takes_images"))
        except model_store.ModelNotAvailableError:
            return False

    def _modalities(self) -> list[str] | None:
        return ["text", "image"] if self._takes_images() else None

    async def info(self, request: web.Request) -> web.Response:
        return json_response(self.info_struct())

    async def models(self, request: web.Request) -> web.Response:
        base = self.settings.model_id
        model = tgi.ModelInfo(id=base, object="model", created=0, owned_by=base, input_modalities=self._modalities())
        loras = [
            tgi.ModelInfo(id=n, object="model", created=0, owned_by=base, parent=base)
            for n in lora.names(self.settings)
        ]
        others = []  # the other models live replicas announce, each with its adapters (services/http/models.py)
        for name, adapters in models.FLEET.served().items():
            if name != base:
                others.append(tgi.ModelInfo(id=name, object="model", created=0, owned_by=name))
                others += [tgi.ModelInfo(id=n, object="model", created=0, owned_by=name, parent=name) for n in adapters]
        return json_response(tgi.ModelsInfo(object="list", data=[model, *loras, *others]))

    async def metrics(self, request: web.Request) -> web.Response:
        render = getattr(self.ingress, "metrics_text", local_metrics)
        return web.Response(body=render().encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def docs(self, request: web.Request) -> web.Response:
        return web.Response(text=SWAGGER_UI, content_type="text/html")

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            self._openapi = orjson.dumps(openapi.document(self.settings, tgi.VERSION))
        return web.Response(body=self._openapi, content_type="application/json")
