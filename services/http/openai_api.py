"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /chat_tokenize (TGI's versions of them).

Each request becomes TGI GenerateRequests on the bus (chat: the messages, rendered by the tokenizer's chat
template; completions: one request per prompt). Errors found before generation (body shape, suffix, batch
size, tools, template) are an HTTP status with TGI's JSON body even when streaming; once a stream has begun,
an error is OpenAI's in-stream event followed by `data: [DONE]`, as TGI does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import orjson
from aiohttp import web
from msgspec import to_builtins

from libs.protocol.messages import GenerateRequest, TextRow
from libs.protocol.params import Parameters
from services.http import middleware, openai_tools
from services.http import openai_schemas as oa
from services.http.ingress import Failure, Timing
from services.http.schemas import simple_tokens  # the /tokenize route's offsets, shared

# errors TGI raises before its stream exists (template and tools are applied first): a real HTTP status
PRE_STREAM_ERRORS = frozenset({"template_error", "missing_template_variable", "tool_error"})
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = oa.sse("[DONE]")


def _error(status: int, message: str, error_type: str) -> web.Response:
    return web.Response(
        body=orjson.dumps({"error": message, "error_type": error_type}),
        status=status,
        content_type="application/json",
    )


def _json(obj, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), headers=headers, content_type="application/json")


def stream_error(e: Failure) -> bytes:
    """OpenAI's in-stream error event; TGI's `into_openai_event` says 422 whatever the error (kept, as clients
    of TGI may match on it)."""
    return oa.sse({"error": {"message": e.message, "http_status_code": 422}})


def _characters(messages: list[dict]) -> str:
    """The text of the messages, for x-compute-characters (TGI counts the rendered prompt, which only the
    tokenizer sees)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return "".join(out)


def _sum_headers(all_headers: list[dict[str, str]]) -> dict[str, str]:
    """TGI's completions headers: each prompt's numbers added up."""
    out = dict(all_headers[0])
    for key in out:
        if key == "x-compute-time":
            out[key] = repr(sum(float(h[key]) for h in all_headers))
        elif key != "x-compute-type":
            out[key] = str(sum(int(h[key]) for h in all_headers))
    return out


def _fingerprint() -> str:
    from services.http.routes import VERSION  # late: routes.py may import this module (/invocations)

    return f"{VERSION}-native"  # TGI: "{version}-{docker_label or 'native'}"


class OpenAIRoutes:
    def __init__(self, settings, ingress, routes):
        self.settings = settings
        self.ingress = ingress
        self.routes = routes

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/chat_tokenize", self.chat_tokenize)

    # ---- helpers --------------------------------------------------------------------------
    def _request(self, parameters: Parameters, **fields) -> GenerateRequest:
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            ingress=self.ingress.index,
            parameters=parameters,
            received_at=time.time(),
            traceparent=fields.pop("traceparent", None),
            **fields,
        )

    def _chat_request(self, request: web.Request, body: oa.ChatBody, mode: str = "generate"):
        tools, grammar = openai_tools.tool_grammar(body)
        wire = self._request(
            oa.chat_parameters(body, grammar, self.settings.model_id),
            inputs="",
            add_special_tokens=False,  # the template holds the special tokens
            mode=mode,
            stream=body.stream,
            messages=body.messages,
            tools=tools,
            chat_template_kwargs=body.chat_template_kwargs,
            traceparent=request.headers.get("traceparent"),
        )
        return wire, grammar is not None and tools is not None

    async def _open(self, request: web.Request, inputs: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, **middleware.stream_headers(inputs)})
        await response.prepare(request)
        return response

    # ---- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = oa.parse(await request.read(), oa.ChatBody)
            wire, using_tools = self._chat_request(request, body)
        except oa.OpenAIError as e:
            return _error(e.status, e.message, e.error_type)
        model = body.model if body.model not in (None, "tgi") else self.settings.model_id
        env = oa.Envelope(model, _fingerprint())
        logprobs = bool(body.logprobs)
        if body.stream:
            return await self._chat_stream(request, body, wire, env, logprobs)
        timing = Timing(start=time.monotonic())
        try:
            with self.routes.permit():
                collected = await self._collect(wire, timing)
            tool_calls = None
            if using_tools:
                tool_calls = openai_tools.parse_tool_call(collected[-1].final.generated_text)
                if tool_calls is None:  # the model chose no_tool: its content is the answer
                    collected[-1].final.generated_text = openai_tools.no_tool_content(
                        collected[-1].final.generated_text
                    )
        except Failure as e:
            return _error(e.status, e.message, e.error_type)
        except oa.OpenAIError as e:
            return _error(e.status, e.message, e.error_type)
        headers = middleware.timing_headers(timing, _characters(body.messages), collected[-1].final)
        return _json(env.chat_completion(collected, logprobs, tool_calls), headers)

    async def _chat_stream(self, request, body: oa.ChatBody, wire, env: oa.Envelope, logprobs: bool):
        response = None
        try:
            with self.routes.permit():
                async with contextlib.aclosing(self.ingress.generate(wire)) as rows:
                    async for row in rows:
                        if response is None:  # the template rendered and validation passed
                            response = await self._open(request, _characters(body.messages))
                        await response.write(oa.sse(env.chat_chunk(row, logprobs)))
                        if row.final is not None and body.include_usage:
                            await response.write(oa.sse(env.usage_chunk(row.final)))
        except Failure as e:
            if response is None:
                if e.error_type in PRE_STREAM_ERRORS:
                    return _error(e.status, e.message, e.error_type)
                response = await self._open(request, _characters(body.messages))
            await response.write(stream_error(e))
        except ConnectionResetError:  # the client went away; closing the rows above aborted the request
            return response or web.Response()
        if body.sends_done:
            await response.write(DONE)
        await response.write_eof()
        return response

    # ---- /v1/completions -------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = oa.parse(await request.read(), oa.CompletionBody)
        except oa.OpenAIError as e:
            return _error(e.status, e.message, e.error_type)
        if body.suffix is not None:
            return _error(
                422, "Suffix is not supported and can be achieved by preprocessing the prompt.", "suffix not supported"
            )
        prompts = body.prompts
        limit = self.settings.max_client_batch_size
        if len(prompts) > limit:
            return _error(
                422, f"Number of prompts exceeds the maximum allowed batch size of {limit}", "batch size exceeded"
            )
        params = oa.completion_parameters(body, self.settings.model_id)
        traceparent = request.headers.get("traceparent")
        wires = [
            self._request(params, inputs=p, stream=body.stream, traceparent=traceparent) for p in prompts
        ]  # add_special_tokens stays True, as TGI's completions
        env = oa.Envelope(self.settings.model_id, _fingerprint())
        if body.stream:
            return await self._completion_stream(request, body, wires, env)
        timings = [Timing(start=time.monotonic()) for _ in wires]
        try:
            with self.routes.permit(len(wires)):  # TGI takes one permit per prompt
                results = await asyncio.gather(*(self._collect(w, t) for w, t in zip(wires, timings)))
        except Failure as e:
            return _error(e.status, e.message, e.error_type)
        end = time.monotonic()
        headers = _sum_headers(
            [middleware.timing_headers(t, p, r[-1].final, end) for t, p, r in zip(timings, prompts, results)]
        )
        return _json(env.completion(list(zip(prompts, results)), bool(body.echo)), headers)

    async def _collect(self, wire: GenerateRequest, timing: Timing) -> list[TextRow]:
        async with contextlib.aclosing(self.ingress.generate(wire, timing)) as rows:
            return [row async for row in rows]

    async def _completion_stream(self, request, body: oa.CompletionBody, wires, env: oa.Envelope):
        """The prompts' streams interleaved as their tokens come; one [DONE] at the end."""
        response = await self._open(request, "".join(w.inputs for w in wires))
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, wire: GenerateRequest) -> None:
            prefix = wire.inputs if body.echo else ""
            try:
                with self.routes.permit():
                    async with contextlib.aclosing(self.ingress.generate(wire)) as rows:
                        async for row in rows:
                            queue.put_nowait(oa.sse(env.completion_chunk(index, row, prefix)))
                            prefix = ""
            except Failure as e:
                queue.put_nowait(stream_error(e))
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, w)) for i, w in enumerate(wires)]
        try:
            running = len(tasks)
            while running:
                event = await queue.get()
                if event is None:
                    running -= 1
                else:
                    await response.write(event)
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass
        finally:
            for task in tasks:  # a client gone away: cancelling closes each stream, which aborts it
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return response

    # ---- /chat_tokenize --------------------------------------------------------------------
    async def chat_tokenize(self, request: web.Request) -> web.Response:
        """TGI's ChatTokenizeResponse: the rendered template and its tokens (no permit, as TGI)."""
        try:
            body = oa.parse(await request.read(), oa.ChatBody)
            wire, _ = self._chat_request(request, body, mode="tokenize")
            result = await self.ingress.tokenize(wire)
        except oa.OpenAIError as e:
            return _error(e.status, e.message, e.error_type)
        except Failure as e:
            return _error(e.status, e.message, e.error_type)
        tokens = simple_tokens(result.text, result.ids, result.starts, result.stops)
        return _json({"tokenize_response": to_builtins(tokens), "templated_text": result.text})
