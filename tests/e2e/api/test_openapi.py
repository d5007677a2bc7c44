"""The server's own OpenAPI document (/api-doc/openapi.json) is a valid OpenAPI document, /docs serves Swagger UI
for it, and the real responses of every route validate against the schemas it declares."""

from __future__ import annotations

import pytest
import requests
from openapi_spec_validator import validate

from tests.e2e.conftest import sse_events

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over a lazy dog"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]

# TGI's documented paths; ours must describe at least these
TGI_PATHS = {
    "/",
    "/chat_tokenize",
    "/generate",
    "/generate_stream",
    "/health",
    "/info",
    "/invocations",
    "/metrics",
    "/tokenize",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
}


def test_document_is_valid_openapi(openapi):
    validate(openapi.doc)  # raises on any violation of the OpenAPI 3.x meta-schema
    assert TGI_PATHS <= set(openapi.doc["paths"]), sorted(TGI_PATHS - set(openapi.doc["paths"]))
    assert "post" in openapi.doc["paths"]["/generate"] and "get" in openapi.doc["paths"]["/info"]


def test_docs_page_points_at_the_document(tiny_server):
    r = requests.get(tiny_server.url + "/docs", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/api-doc/openapi.json" in r.text


# (path, body): non-streaming POSTs whose 200 body must match the document
POSTS = [
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}),
    (
        "/generate",
        {
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 2},
        },
    ),
    (
        "/generate",
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "best_of": 2, "do_sample": True, "details": True}},
    ),
    ("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}),
    ("/tokenize", {"inputs": PROMPT}),
    ("/chat_tokenize", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": [PROMPT, "a lazy dog"], "max_tokens": 3}),
    ("/invocations", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}),
    ("/invocations", {"messages": CHAT, "max_tokens": 3}),
    ("/invocations", {"prompt": PROMPT, "max_tokens": 3}),
]


@pytest.mark.parametrize("path,body", POSTS, ids=[f"{p} {i}" for i, (p, _) in enumerate(POSTS)])
def test_post_responses_match_the_document(tiny_server, openapi, path, body):
    r = requests.post(tiny_server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    openapi.check(path, "post", 200, r.json())


# (path, body): streaming POSTs whose every event must match the document's text/event-stream schema
STREAMS = [
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True, "top_n_tokens": 2}}),
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4}}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True}),
]


@pytest.mark.parametrize("path,body", STREAMS, ids=[p for p, _ in STREAMS])
def test_stream_events_match_the_document(tiny_server, openapi, path, body):
    r = requests.post(tiny_server.url + path, json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse_events(r.content)
    assert events
    for event in events:
        if event != "[DONE]":
            openapi.check(path, "post", 200, event, "text/event-stream")


@pytest.mark.parametrize("path", ["/info", "/v1/models"])
def test_get_responses_match_the_document(tiny_server, openapi, path):
    r = requests.get(tiny_server.url + path, timeout=10)
    assert r.status_code == 200
    openapi.check(path, "get", 200, r.json())


# (path, body, status): errors must be documented with the shape they have
ERRORS = [
    ("/generate", {"inputs": PROMPT, "parameters": {"top_p": 1.0}}, 422),
    ("/", {"inputs": "", "parameters": {}}, 422),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 422),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, 422),
]


@pytest.mark.parametrize("path,body,status", ERRORS, ids=[p for p, _, _ in ERRORS])
def test_error_responses_match_the_document(tiny_server, openapi, path, body, status):
    r = requests.post(tiny_server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    openapi.check(path, "post", status, r.json())
