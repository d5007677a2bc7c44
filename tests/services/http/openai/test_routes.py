"""The OpenAI routes over HTTP, against a scripted ingress (the http layer only; e2e tests run the real model).

Shapes are checked by parsing them with the clients' own models: the `openai` SDK's pydantic types (and the
SDK itself, talking to the route), and the `text-generation` client's chat types.
"""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import orjson
import pytest
import text_generation
import text_generation.types as tg
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from libs.protocol.messages import FinalInfo, TextRow, TokenizeResult, TokenText
from libs.runtime.settings import Settings
from services.http.errors import Failure
from services.http.generation import Permits
from services.http.openai.routes import OpenAIRoutes

MODEL = "org/tiny"
SETTINGS = Settings(model_id=MODEL, max_client_batch_size=3)


def script(texts, reason="eos_token", input_length=5, top=0, special_last=None):
    """TextRows as the detokenizer sends them: incremental texts, the last with FinalInfo."""
    special_last = reason == "eos_token" if special_last is None else special_last
    rows = []
    for i, text in enumerate(texts):
        alts = [TokenText(id=100 + k, text=f"alt{k}", logprob=-1.0 - k) for k in range(top)]
        rows.append(
            TextRow(
                request_id="r", index=i + 1, token_id=10 + i, text=text, logprob=-0.5, special=False, top_tokens=alts
            )
        )
    if special_last:
        rows[-1].special = True
    generated = "".join(t for t in texts[:-1]) + ("" if special_last else texts[-1])
    rows[-1].final = FinalInfo(
        generated_text=generated, finish_reason=reason, generated_tokens=len(texts), input_length=input_length
    )
    return rows


class FakeIngress:
    index = 0

    def __init__(self):
        self.requests = []
        self.scripts = {}  # inputs → rows or Failure; "" (chat) by default
        self.closed = []

    def ready(self, request_id):
        return False  # rows come one at a time here

    async def generate(self, req, timing=None):
        self.requests.append(req)
        outcome = self.scripts.get(req.inputs, self.scripts.get("*"))
        try:
            if isinstance(outcome, Failure):
                raise outcome
            for row in outcome:
                await asyncio.sleep(0)
                yield row
        finally:
            self.closed.append(req.request_id)

    async def tokenize(self, req):
        self.requests.append(req)
        text = "<|user|>héllo"
        return TokenizeResult(
            request_id=req.request_id,
            text=text,
            ids=np.array([1, 2, 3], dtype=np.int32),
            starts=np.array([0, 8, 10], dtype=np.uint32),
            stops=np.array([8, 10, 13], dtype=np.uint32),
        )


def serve(test, limit=10, settings=SETTINGS):
    """Run `test(client, ingress)` against the OpenAI routes on a real local port."""
    ingress, permits = FakeIngress(), Permits(limit)

    async def main():
        app = web.Application()
        OpenAIRoutes(settings, ingress, permits).install(app)
        async with TestClient(TestServer(app)) as client:
            await test(client, ingress)
        assert permits.in_flight == 0  # every permit returned

    asyncio.run(main())
    return ingress


def events(raw: bytes) -> list:
    """SSE `data: ` events; [DONE] kept as the string."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


MSG = {"messages": [{"role": "user", "content": "hi"}]}


# ---- chat ---------------------------------------------------------------------------------------
def test_chat_non_stream_shape_and_wire_request():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["Hel", "lo", "</s>"], top=2)
        r = await client.post("/v1/chat/completions", json={**MSG, "logprobs": True, "top_logprobs": 2, "seed": 1})
        assert r.status == 200
        body = await r.json()
        parsed = ChatCompletion.model_validate(body)
        assert parsed.choices[0].message.content == "Hello"
        assert parsed.choices[0].finish_reason == "stop"  # eos_token → stop
        assert parsed.usage.model_dump(exclude_none=True) == {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
        }
        assert (body["id"], body["model"], body["object"]) == ("", MODEL, "chat.completion")
        assert body["system_fingerprint"].endswith("-native")
        content = body["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == ["Hel", "lo", "</s>"]
        assert content[0]["top_logprobs"] == [{"token": "alt0", "logprob": -1.0}, {"token": "alt1", "logprob": -2.0}]
        tg.ChatComplete(**body)  # the text-generation client's model
        assert (r.headers["x-prompt-tokens"], r.headers["x-generated-tokens"]) == ("5", "3")
        assert r.headers["x-compute-characters"] == "2" and "x-total-time" in r.headers

        wire = ingress.requests[0]
        assert wire.inputs == "" and wire.add_special_tokens is False and wire.mode == "generate"
        assert wire.messages == MSG["messages"] and wire.stream is False
        assert wire.parameters.seed == 1 and wire.parameters.top_n_tokens == 2 and wire.parameters.details

    serve(test)


def test_chat_logprobs_null_unless_asked_and_model_echo():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["a", "b"], reason="length", special_last=False)
        body = await (await client.post("/v1/chat/completions", json={**MSG, "model": "my-lora"})).json()
        assert body["choices"][0]["logprobs"] is None
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
        assert body["model"] == "my-lora"  # TGI echoes a model it took as an adapter
        body = await (await client.post("/v1/chat/completions", json={**MSG, "model": "tgi"})).json()
        assert body["model"] == MODEL

    serve(test, settings=SETTINGS.replace(lora_adapters="my-lora=/adapters/my-lora"))


def test_chat_stream_chunks_usage_and_done():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["Hel", "lo", "</s>"], top=1)
        req = {**MSG, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/chat/completions", json=req)
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["X-Accel-Buffering"] == "no" and r.headers["x-compute-characters"] == "2"
        evs = events(await r.read())
        assert evs[-1] == "[DONE]"
        chunks = [ChatCompletionChunk.model_validate(e) for e in evs[:-1]]
        assert [c.choices[0].delta.content for c in chunks[:3]] == ["Hel", "lo", ""]  # a special token is ""
        assert all(c.choices[0].delta.role == "assistant" for c in chunks[:3])
        assert [c.choices[0].finish_reason for c in chunks[:3]] == [None, None, "stop"]
        assert chunks[0].choices[0].logprobs.content[0].top_logprobs[0].token == "alt0"
        assert all(e["usage"] is None for e in evs[:3])
        assert evs[3]["choices"] == [] and evs[3]["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
        }
        for e in evs[:-1]:
            tg.ChatCompletionChunk(**e)  # needs delta.role and delta.tool_calls on every chunk
        assert ingress.requests[0].stream is True

    serve(test)


def test_chat_stream_without_usage_has_no_usage_chunk():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["a", "b"], reason="stop_sequence", special_last=False)
        evs = events(await (await client.post("/v1/chat/completions", json={**MSG, "stream": True})).read())
        assert len(evs) == 3 and evs[-1] == "[DONE]"
        assert evs[1]["choices"][0]["finish_reason"] == "stop_sequence"  # TGI's format(true) keeps it
        assert evs[0]["choices"][0]["logprobs"] is None

    serve(test)


def test_chat_stream_errors():
    async def test(client, ingress):
        # a template error happens before TGI's stream exists: a real 422 with TGI's body
        ingress.scripts["*"] = Failure("Template error: template not found", "template_error")
        r = await client.post("/v1/chat/completions", json={**MSG, "stream": True})
        assert r.status == 422
        assert await r.json() == {"error": "Template error: template not found", "error_type": "template_error"}
        # a validation error comes in-stream (HTTP 200), OpenAI's shape, then [DONE]
        msg = "Input validation error: `top_p` must be > 0.0 and < 1.0"
        ingress.scripts["*"] = Failure(msg, "validation")
        r = await client.post("/v1/chat/completions", json={**MSG, "stream": True, "top_p": 1.0})
        assert r.status == 200
        assert events(await r.read()) == [{"error": {"message": msg, "http_status_code": 422}}, "[DONE]"]
        # not streaming: the status and TGI's body
        r = await client.post("/v1/chat/completions", json={**MSG, "top_p": 1.0})
        assert r.status == 422 and (await r.json())["error"] == msg
        # body errors: 422 / 400 before anything, even when streaming
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user"}], "stream": True})
        assert r.status == 422 and (await r.json())["error"].startswith("Failed to deserialize")
        r = await client.post("/v1/chat/completions", data=b"{oops")
        assert r.status == 400
        # a tool error (the tokenizer's) is an HTTP status even when streaming, as TGI's
        ingress.scripts["*"] = Failure("Tool error: Grammar and tools are mutually exclusive", "tool_error")
        r = await client.post("/v1/chat/completions", json={**MSG, "stream": True, "tools": []})
        assert r.status == 422
        assert await r.json() == {
            "error": "Tool error: Grammar and tools are mutually exclusive",
            "error_type": "tool_error",
        }

    serve(test)


def test_chat_overloaded():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["a"])
        r = await client.post("/v1/chat/completions", json=MSG)
        assert r.status == 429 and await r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        r = await client.post("/v1/chat/completions", json={**MSG, "stream": True})
        assert r.status == 200
        assert events(await r.read()) == [
            {"error": {"message": "Model is overloaded", "http_status_code": 422}},
            "[DONE]",
        ]

    serve(test, limit=0)


def test_chat_tools_go_to_the_tokenizer_with_their_grammar():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

    async def test(client, ingress):
        ingress.scripts["*"] = script(['{"function": {"_name": "f", "x": 1}}'], special_last=False)
        body = await (
            await client.post("/v1/chat/completions", json={**MSG, "tools": tools, "tool_choice": "f"})
        ).json()
        wire = ingress.requests[0]
        assert wire.tools == tools and wire.tool_choice == "f" and wire.parameters.grammar is None
        call = ChatCompletion.model_validate(body).choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == ("f", '{ "x": 1}')
        assert "content" not in body["choices"][0]["message"]
        ingress.scripts["*"] = script(["Just ", "words."], special_last=False)
        body = await (await client.post("/v1/chat/completions", json={**MSG, "tools": tools})).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Just words."}  # auto: content
        assert ingress.requests[1].tool_choice is None

    serve(test)


def test_chat_tokenize():
    async def test(client, ingress):
        r = await client.post("/chat_tokenize", json={**MSG, "chat_template_kwargs": {"x": 1}})
        assert r.status == 200
        body = await r.json()
        assert body["templated_text"] == "<|user|>héllo"
        assert [t["id"] for t in body["tokenize_response"]] == [1, 2, 3]
        assert [t["text"] for t in body["tokenize_response"]] == ["<|user|>", "hé", "llo"]
        wire = ingress.requests[0]
        assert wire.mode == "tokenize" and wire.messages == MSG["messages"] and wire.chat_template_kwargs == {"x": 1}

    serve(test, limit=0)  # no permit needed, as TGI


# ---- the official SDK against the routes ----------------------------------------------------------
def test_openai_sdk_chat_and_completions():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["Hi", " there", "</s>"], top=2)
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="-", max_retries=0)
        msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
        out = await sdk.chat.completions.create(model="tgi", messages=msgs, max_tokens=3, temperature=0)
        assert out.choices[0].message.content == "Hi there" and out.usage.total_tokens == 8
        assert ingress.requests[-1].parameters.do_sample is False
        stream = await sdk.chat.completions.create(
            model="tgi",
            messages=msgs,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "Hi there"
        assert chunks[-1].usage.completion_tokens == 3
        assert [len(c.choices[0].logprobs.content[0].top_logprobs) for c in chunks if c.choices] == [2, 2, 2]
        done = await sdk.completions.create(model="tgi", prompt="x", max_tokens=3)
        assert done.choices[0].text == "Hi there"
        stream = await sdk.completions.create(model="tgi", prompt="x", max_tokens=3, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == "Hi there</s>"
        with pytest.raises(openai.UnprocessableEntityError):
            await sdk.completions.create(model="tgi", prompt="x", suffix="y")
        await sdk.close()

    serve(test)


def test_text_generation_client_chat_stream():
    """TGI's own client json-parses every `data:` line, [DONE] included: its streams end without it."""

    async def test(client, ingress):
        ingress.scripts["*"] = script(["Hel", "lo", "</s>"])
        tgc = text_generation.AsyncClient(str(client.make_url("")))
        got = [c async for c in await tgc.chat(messages=MSG["messages"], max_tokens=3, temperature=0, stream=True)]
        assert [c.choices[0].delta.content for c in got] == ["Hel", "lo", ""]
        assert got[-1].choices[0].finish_reason == "stop"
        done = await tgc.chat(messages=MSG["messages"], max_tokens=3)
        assert done.choices[0].message.content == "Hello"
        # any other client, even one naming the model "tgi", gets TGI's [DONE]
        r = await client.post("/v1/chat/completions", json={**MSG, "model": "tgi", "stream": True})
        assert events(await r.read())[-1] == "[DONE]"

    serve(test)
