"""Our OpenAPI document: it validates, it lists exactly the routes we serve, and the real responses of
the routes (over a fake bus) validate against it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openapi_spec_validator import validate

from libs.runtime.settings import Settings
from services.http import openapi
from services.http.errors import Failure
from tests.services.http.fakes import FakeIngress, client, rows, run


def doc(**settings) -> dict:
    return openapi.document(Settings(**settings), "3.3.6-dev0")


def check(document: dict, schema: dict, instance) -> None:
    """Validate `instance` against a schema of `document`, resolving its $refs within the document."""
    root = {**schema, "components": document["components"]}
    jsonschema.Draft202012Validator(root).validate(instance)


def response_schema(document: dict, method: str, path: str, status: str, media: str) -> dict:
    return document["paths"][path][method]["responses"][status]["content"][media]["schema"]


@pytest.mark.parametrize("settings", [{}, {"api_key": "k"}])
def test_document_validates(settings):
    document = doc(**settings)
    validate(document)
    generate = document["paths"]["/generate"]["post"]
    assert ("security" in generate) == bool(settings)
    assert "security" not in document["paths"]["/info"]["get"]


def test_document_lists_exactly_the_served_routes():
    async def scenario():
        async with client(FakeIngress()) as c:
            return {(r.method, r.resource.canonical) for r in c.app.router.routes() if r.method not in ("HEAD",)}

    served = run(scenario())
    documented = {(m.upper(), p) for p, ops in doc()["paths"].items() for m in ops}
    assert served == documented


def test_served_document_is_the_built_one():
    async def scenario():
        async with client(FakeIngress()) as c:
            r = await c.get("/api-doc/openapi.json")
            return await r.json()

    served = run(scenario())
    validate(served)
    assert served["info"]["version"] == "3.3.6-dev0" and "/generate" in served["paths"]


def test_real_responses_validate():
    def answer(req, n):
        if req.inputs == "fail":
            return Failure("Input validation error: `top_p` must be > 0.0 and < 1.0", "validation")
        lps = [-0.5, -1.0] if n % 2 else [-2.0, -1.0]
        return rows(req.request_id, [" a", "b"], lps, top_n=2, prefill=True, seed=5 + n)

    full = {"details": True, "decoder_input_details": True, "top_n_tokens": 2, "do_sample": True}

    async def scenario():
        async with client(FakeIngress(answer)) as c:
            out = {}
            for key, path, body in [
                ("generate", "/generate", {"inputs": "p", "parameters": full}),
                ("best_of", "/generate", {"inputs": "p", "parameters": {**full, "best_of": 2}}),
                ("plain", "/generate", {"inputs": "p"}),
                ("compat", "/", {"inputs": "p", "parameters": full}),
                ("stream", "/generate_stream", {"inputs": "p", "parameters": {"details": True, "top_n_tokens": 2}}),
                ("stream_error", "/generate_stream", {"inputs": "fail"}),
                ("error", "/generate", {"inputs": "fail"}),
                ("tokenize", "/tokenize", {"inputs": "a b"}),
            ]:
                r = await c.post(path, json=body)
                out[key] = (r.status, await r.read())
            for path in ("/info", "/v1/models"):
                r = await c.get(path)
                out[path] = (r.status, await r.read())
            return out

    out = run(scenario())
    document = doc()
    post_ok = lambda path, media="application/json": response_schema(document, "post", path, "200", media)  # noqa: E731
    for key in ("generate", "best_of", "plain"):
        check(document, post_ok("/generate"), json.loads(out[key][1]))
    assert "best_of_sequences" in json.loads(out["best_of"][1])["details"]
    check(document, post_ok("/"), json.loads(out["compat"][1]))
    for key in ("stream", "stream_error"):
        events = [json.loads(line[6:]) for line in out[key][1].split(b"\n") if line.startswith(b"data: ")]
        assert events
        for event in events:
            check(document, post_ok("/generate_stream", "text/event-stream"), event)
    assert out["error"][0] == 422
    check(
        document, response_schema(document, "post", "/generate", "422", "application/json"), json.loads(out["error"][1])
    )
    check(document, post_ok("/tokenize"), json.loads(out["tokenize"][1]))
    check(document, response_schema(document, "get", "/info", "200", "application/json"), json.loads(out["/info"][1]))
    check(
        document,
        response_schema(document, "get", "/v1/models", "200", "application/json"),
        json.loads(out["/v1/models"][1]),
    )
    # and a wrong shape does not
    with pytest.raises(jsonschema.ValidationError):
        check(document, post_ok("/generate"), {"generated_text": "x", "details": {"finish_reason": "length"}})


def test_real_openai_responses_validate():
    """The OpenAI routes' bodies and events are the document's structs too (over a fake bus: tokens with
    alternatives, a forced tool call, errors before and inside a stream)."""

    def answer(req, n):
        last = (req.messages or [{}])[-1].get("content")
        if req.inputs == "fail" or last == "fail":
            return Failure("Input validation error: `top_p` must be > 0.0 and < 1.0", "validation")
        if last == "tool":
            return rows(req.request_id, ['{"function": {"_name": "f", "x": 1}}'], [-0.5])
        return rows(req.request_id, [" a", "b"], [-0.5, -1.0], top_n=2, finish="eos_token")

    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    cases = [
        ("/v1/chat/completions", {"messages": chat, "logprobs": True, "top_logprobs": 2}, 200),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tool"}], "tools": tools}, 200),
        ("/v1/chat/completions", {"messages": chat, "stream": True, "stream_options": {"include_usage": True}}, 200),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fail"}], "stream": True}, 200),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fail"}]}, 422),
        ("/v1/completions", {"prompt": ["p", "q"], "echo": True}, 200),
        ("/v1/completions", {"prompt": ["p", "fail"], "stream": True}, 200),
        ("/v1/completions", {"prompt": "p", "suffix": "s"}, 422),
        ("/chat_tokenize", {"messages": chat}, 200),
        ("/invocations", {"messages": chat}, 200),
        ("/invocations", {"prompt": "p", "stream": True}, 200),
    ]

    async def scenario():
        async with client(FakeIngress(answer)) as c:
            out = []
            for path, body, _ in cases:
                r = await c.post(path, json=body)
                out.append((r.status, r.headers["Content-Type"].split(";")[0], await r.read()))
            return out

    document = doc()
    for (path, _, status), (got, media, raw) in zip(cases, run(scenario())):
        assert got == status, (path, raw)
        schema = response_schema(document, "post", path, str(status), media)
        if media == "text/event-stream":
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            for event in events[:-1]:
                check(document, schema, json.loads(event))
        else:
            check(document, schema, json.loads(raw))


@pytest.mark.parametrize(
    "path, body, struct",
    [
        ("/generate", lambda seed: {"inputs": "p", "parameters": {"seed": seed}}, "GenerateParameters"),
        (
            "/v1/chat/completions",
            lambda seed: {"messages": [{"role": "user", "content": "hi"}], "seed": seed},
            "ChatRequest",
        ),
        ("/v1/completions", lambda seed: {"prompt": "p", "seed": seed}, "CompletionRequest"),
    ],
)
def test_seed_takes_the_documented_bound(path, body, struct):
    """`seed` is TGI's u64 on every route: the document's bound is the parser's."""
    seed = doc()["components"]["schemas"][struct]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (0, 2**64 - 1)

    async def scenario():
        async with client(FakeIngress()) as c:
            out = []
            for value in (2**64 - 1, 2**64, -1):
                r = await c.post(path, json=body(value))
                out.append((r.status, await r.json()))
            return out

    (top, _), (over, error), (negative, _) = run(scenario())
    assert (top, over, negative) == (200, 422, 422)
    assert error["error"].endswith(
        f"seed: invalid value: integer `{2**64}`, expected u64"
        + (" - at `$.parameters`" if path == "/generate" else "")
    )


def test_openai_examples_from_the_reference_validate():
    """The shapes TGI documents for its OpenAI routes fit our schemas."""
    document = doc()
    chat = {
        "object": "chat.completion",
        "id": "",
        "created": 1741372335,
        "model": "m",
        "system_fingerprint": "3.3.6-dev0-native",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    chunk = {
        "object": "chat.completion.chunk",
        "id": "",
        "created": 1,
        "model": "m",
        "system_fingerprint": "x",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    }
    tool_chunk = {
        **chunk,
        "choices": [
            {
                "index": 0,
                "delta": {
                    "role": "assistant",
                    "tool_calls": [
                        {"index": 0, "id": "0", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                },
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    usage_chunk = {**chunk, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    completion = {
        "object": "text_completion",
        "id": "",
        "created": 1,
        "model": "m",
        "system_fingerprint": "x",
        "choices": [{"index": 0, "text": "t", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    stream_error = {"error": {"message": "Input validation error: x", "http_status_code": 422}}
    chat_ok = response_schema(document, "post", "/v1/chat/completions", "200", "application/json")
    chat_sse = response_schema(document, "post", "/v1/chat/completions", "200", "text/event-stream")
    check(document, chat_ok, chat)
    for event in (chunk, tool_chunk, usage_chunk, stream_error):
        check(document, chat_sse, event)
    check(document, response_schema(document, "post", "/v1/completions", "200", "application/json"), completion)
    check(document, response_schema(document, "post", "/v1/completions", "200", "text/event-stream"), stream_error)
    with pytest.raises(jsonschema.ValidationError):
        check(document, chat_ok, {**chat, "object": "text_completion"})
