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

import msgspec
from aiohttp import web

from libs.protocol.messages import GenerateRequest
from libs.runtime.settings import Settings
from services.http.chat_formats import ChatFormats
from services.http.chat_path import chat_wire
from services.http.errors import Failure, OpenAIFailure, error_response, openai_error_response, openai_stream_error
from services.http.generation import Permits, bus_request
from services.http.models import check_model
from services.http.openai import choices, tools
from services.http.openai import requests as oa
from services.http.openai import responses as oar
from services.http.openai.answer import AnswerReader, AnswerStream
from services.http.responses import DONE, json_response, open_stream, sse
from services.http.sse_writer import StepWriter
from services.http.tgi.schemas import VERSION, parse_body, simple_tokens
from services.http.timing import Timing, sum_headers, timing_headers

# errors TGI raises before its stream exists (template and tools are applied first): a real HTTP status
PRE_STREAM_ERRORS = frozenset({"template_error", "missing_template_variable", "tool_error"})
FINGERPRINT = f"{VERSION}-native"  # TGI: "{version}-{docker_label or 'native'}"


def _error(e: Failure) -> web.Response:
    if isinstance(e, OpenAIFailure):  # an unknown model: OpenAI's shape, as its clients expect
        return openai_error_response(e)
    return error_response(e, charset=None)  # these routes' JSON errors have always gone without a charset


def _tool_chunks(
    env: oar.Envelope, reader: tools.ToolStream, row, logprobs: bool, call_id: str, index: int = 0
) -> list:
    """A token of a chat with tools (choice `index`) → its chunks: content, or TGI's tool-call deltas (none while
    the answer's start is held); the finish reason goes on the last chunk of the last token only."""
    chunks = []
    for delta in reader.push("" if row.special else row.text, row.final is not None):
        if delta[0] == "content":
            chunks.append(env.chat_chunk(row, logprobs, delta[1], index))
        else:
            chunks.append(env.tool_chunk(row, call_id, delta[1], delta[2], index))
    for chunk in chunks[:-1]:
        chunk.choices[0].finish_reason = None
    return chunks


def _answer_chunks(env: oar.Envelope, stream: AnswerStream, row, logprobs: bool, index: int = 0) -> list:
    """A token of a chat read in the model's own format → its chunks: reasoning, content and tool-call deltas;
    the last chunk of the last token carries the finish reason (`tool_calls` when the turn ended in calls)."""
    final = row.final is not None
    chunks = []
    for delta in stream.push(stream.piece(row), final):
        if delta[0] == "call":
            d = delta[1]
            chunk = env.tool_chunk(row, d.id or "", d.name, d.arguments, index)
            chunk.choices[0].delta.tool_calls[0].index = d.call
            if d.id is None:  # OpenAI names id and type on a call's first delta only
                chunk.choices[0].delta.tool_calls[0].id = msgspec.UNSET
                chunk.choices[0].delta.tool_calls[0].type = msgspec.UNSET
        else:
            chunk = env.chat_chunk(row, logprobs, delta[1] if delta[0] == "content" else None, index)
            if delta[0] == "reasoning":
                chunk.choices[0].delta.content = None
                chunk.choices[0].delta.reasoning_content = chunk.choices[0].delta.reasoning = delta[1]
        chunks.append(chunk)
    if final and not chunks:
        chunks.append(env.chat_chunk(row, logprobs, "", index))
    for chunk in chunks[:-1]:
        chunk.choices[0].finish_reason = None
    if final and stream.called and chunks[-1].choices[0].finish_reason == "stop":
        chunks[-1].choices[0].finish_reason = "tool_calls"
    return chunks


def _budget(body: oa.ChatRequest) -> int | None:
    try:
        return oa.thinking_budget(body)
    except ValueError as e:
        raise OpenAIFailure(str(e), 422, kind="invalid_request_error", code="invalid_value") from None


def _chat_error(e: Failure, tool_mode) -> web.Response:
    """A chat served in the model's own format answers its refusals in OpenAI's error shape (its SDK reads the
    message there); TGI's way keeps TGI's body."""
    if isinstance(tool_mode, AnswerReader) and tool_mode.native and not isinstance(e, OpenAIFailure):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return openai_error_response(OpenAIFailure(e.message, e.status, kind=kind, code=e.error_type))
    return _error(e)


class OpenAIRoutes:
    def __init__(self, settings: Settings, ingress, permits: Permits):
        self.settings = settings
        self.formats = ChatFormats(settings)  # each served model's tool-call and reasoning formats
        self.ingress = ingress
        self.permits = permits

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/chat_tokenize", self.chat_tokenize)

    # ---- helpers --------------------------------------------------------------------------
    async def _chat_request(self, request: web.Request, mode: str = "generate"):
        """The body, its GenerateRequest (chat_path.chat_wire), and how its answer is read (tools.tool_mode); raises
        Failure. The tokenizer's tool errors come back before any stream, as TGI's."""
        body = parse_body(await request.read(), oa.ChatRequest)
        check_model(body.model, self.settings)
        parameters = oa.chat_parameters(body, self.settings.model_id)
        wire = chat_wire(request, self.ingress.index, body, parameters, mode, _budget(body))
        return body, wire, self.formats.of(wire.model).answer_mode(body, wire.tool_choice)

    # ---- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body, wire, tool_mode = await self._chat_request(request)
            n = choices.check_n(body.n, self.settings.max_concurrent_requests)
        except Failure as e:
            return _error(e)
        model = body.model if body.model not in (None, "tgi") else self.settings.model_id
        env = oar.Envelope(model, FINGERPRINT)
        logprobs = bool(body.logprobs)
        wires = choices.siblings(wire, n)
        if body.stream:
            return await self._chat_stream(request, body, wires, env, logprobs, tool_mode)
        timing = Timing(start=time.monotonic())
        try:
            with self.permits.hold(n):  # a permit per choice, as best_of's sequences
                choices.quiet(self.ingress, wires, n)
                results = await choices.collect_all(self.ingress, wires, [timing] + [None] * (n - 1))
            answers, call_id = [], tools.next_call_id(body.messages)
            for rows in results:
                keeps_special = self.formats.of(wire.model).keeps_special
                if isinstance(tool_mode, str) and keeps_special:  # TGI's tool mode reads no markers
                    final = msgspec.structs.replace(rows[-1].final, generated_text=tools.visible_text(rows))
                    rows = [*rows[:-1], msgspec.structs.replace(rows[-1], final=final)]
                text, tool_calls = rows[-1].final.generated_text, None
                if tool_mode == "call" or (tool_mode == "auto" and tools.is_call(text)):
                    tool_calls = tools.parse_tool_call(text, call_id)
                answers.append((rows, tool_calls))
        except Failure as e:
            return _chat_error(e, tool_mode)
        headers = timing_headers(timing, body.characters, results[0][-1].final)
        completion = env.chat_completions(answers, logprobs)
        if isinstance(tool_mode, AnswerReader):
            for choice, rows in zip(completion.choices, results):
                oar.apply_answer(choice, tool_mode.read(rows[-1].final.generated_text))
        return json_response(completion, headers)

    async def _chat_stream(self, request, body: oa.ChatRequest, wires, env: oar.Envelope, logprobs: bool, tool_mode):
        """The choices' chunks interleaved as their tokens come, each with its index; with include_usage, one usage
        chunk once every choice has ended."""
        response, finals = None, []
        if isinstance(tool_mode, AnswerReader):
            readers = [tool_mode.stream() for _ in wires]
        else:
            readers = [None if tool_mode is None else tools.ToolStream(auto=tool_mode == "auto") for _ in wires]
        call_id = tools.next_call_id(body.messages)
        writer = None
        try:
            with self.permits.hold(len(wires)):
                choices.quiet(self.ingress, wires, len(wires))
                async with contextlib.aclosing(choices.merged(self.ingress, wires)) as rows:
                    async for index, row, more in rows:
                        if response is None:  # the template rendered and validation passed
                            response = await open_stream(request, body.characters)
                            writer = StepWriter(response)
                        if readers[index] is None:
                            events = [sse(env.chat_chunk(row, logprobs, index=index))]
                        elif isinstance(readers[index], AnswerStream):
                            events = [sse(c) for c in _answer_chunks(env, readers[index], row, logprobs, index)]
                        else:
                            events = [sse(c) for c in _tool_chunks(env, readers[index], row, logprobs, call_id, index)]
                        if row.final is not None:
                            finals.append(row.final)
                            if body.include_usage and len(finals) == len(wires):
                                events.append(sse(env.usage_chunk(finals)))
                        await writer.add_all(events, more)  # one write for a step's events
                if writer is not None:
                    await writer.flush()
        except Failure as e:
            if response is None:
                if e.error_type in PRE_STREAM_ERRORS or isinstance(tool_mode, AnswerReader) and tool_mode.native:
                    return _chat_error(e, tool_mode)
                response = await open_stream(request, body.characters)
            else:
                await writer.flush()
            await response.write(sse(openai_stream_error(e)))
        except ConnectionResetError:  # the client went away; closing the rows above aborted the request
            return response or web.Response()
        if body.sends_done:
            await response.write(DONE)
        await response.write_eof()
        return response

    # ---- /v1/completions -------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), oa.CompletionRequest)
            check_model(body.model, self.settings)
            n = choices.check_n(body.n, self.settings.max_concurrent_requests)
            if body.suffix is not None:
                message = "Suffix is not supported and can be achieved by preprocessing the prompt."
                raise Failure(message, "suffix not supported", 422)
            limit = self.settings.max_client_batch_size
            if len(body.prompts) > limit:
                message = f"Number of prompts exceeds the maximum allowed batch size of {limit}"
                raise Failure(message, "batch size exceeded", 422)
        except Failure as e:
            return _error(e)
        params = oa.completion_parameters(body, self.settings.model_id)
        # add_special_tokens stays True, as TGI's completions
        # each prompt's n choices in a row: choice index = prompt index * n + its own
        wires = [
            w for p in body.prompts for w in choices.siblings(self._completion_wire(request, params, p, body.stream), n)
        ]
        env = oar.Envelope(self.settings.model_id, FINGERPRINT)
        if body.stream:
            return await self._completion_stream(request, body, wires, env)
        timings = [Timing(start=time.monotonic()) for _ in wires]
        try:
            with self.permits.hold(len(wires)):  # TGI takes one permit per prompt (here: per choice)
                choices.quiet(self.ingress, wires, n)
                results = await choices.collect_all(self.ingress, wires, timings)
        except Failure as e:
            return _error(e)
        results = choices.share_prompt_details(results, n)
        end = time.monotonic()
        headers = sum_headers(
            [timing_headers(t, w.inputs, r[-1].final, end) for t, w, r in zip(timings, wires, results)]
        )
        prompts = [p for p in body.prompts for _ in range(n)]
        completion = env.completion(
            list(zip(prompts, results)), bool(body.echo), body.logprobs, oa.prompt_only(body), n
        )
        return json_response(completion, headers)

    def _completion_wire(self, request, params, prompt: str | list[int], stream: bool) -> GenerateRequest:
        """One prompt's GenerateRequest: a text, or token ids the tokenizer takes as they are."""
        if isinstance(prompt, str):
            return bus_request(request, self.ingress.index, params, inputs=prompt, stream=stream)
        return bus_request(request, self.ingress.index, params, inputs="", prompt_ids=prompt, stream=stream)

    async def _completion_stream(self, request, body: oa.CompletionRequest, wires, env: oar.Envelope):
        """The prompts' streams interleaved as their tokens come; one [DONE] at the end."""
        response = await open_stream(request, "".join(w.inputs for w in wires))
        writer = StepWriter(response)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, wire: GenerateRequest) -> None:
            prefix, at, logprobs = wire.inputs if body.echo else "", 0, body.logprobs is not None
            try:
                with self.permits.hold():
                    async with contextlib.aclosing(self.ingress.generate(wire)) as rows:
                        async for row in rows:
                            queue.put_nowait(sse(env.completion_chunk(index, row, prefix, logprobs, at)))
                            at, prefix = at + len(prefix) + len(row.text), ""
            except Failure as e:
                queue.put_nowait(sse(openai_stream_error(e)))
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, w)) for i, w in enumerate(wires)]
        try:
            running = len(tasks)
            while running:
                event = await queue.get()
                if event is None:
                    running -= 1
                else:  # one write for what the pumps have queued meanwhile (a step's rows)
                    await writer.add(event, not queue.empty())
            await writer.flush()
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
            _, wire, _ = await self._chat_request(request, mode="tokenize")
            result = await self.ingress.tokenize(wire)
        except Failure as e:
            return _error(e)
        tokens = simple_tokens(result.text, result.ids, result.starts, result.stops)
        return json_response(oar.ChatTokenizeResponse(tokens, result.text))
