"""Hostile input against the real server (tiny model): invalid UTF-8, huge numbers, JSON nested 100k deep, a
10 MB body, unknown fields, nulls everywhere, NUL and control characters, 1000 stop sequences; then schemathesis
against our own OpenAPI document. Every answer is TGI's JSON error shape (or a success), never a 5xx, and the
server stays healthy and serves a normal request afterwards."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from services.http.lora import ROUTES as ADAPTER_ROUTES
from tests.e2e.conftest import sse_events

pytestmark = pytest.mark.e2e

JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "hi"}]
DEEP = 100_000


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


def assert_error(r: requests.Response, status: int | tuple[int, ...], fragment: str = "") -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), body
    assert fragment in body["error"], body
    return body


def assert_served(url: str) -> None:
    assert requests.get(url + "/health", timeout=10).status_code == 200
    ok = requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200 and "generated_text" in ok.json(), ok.text


# (path, raw body, status, fragment of the error)
BAD_BODIES = [
    ("/generate", b'{"inputs": "\xff\xfe hi"}', 400, "Failed to parse the request body as JSON"),
    ("/generate", b'{"inputs": "hi \xed\xa0\x80"}', 400, "Failed to parse"),  # an encoded lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, "Failed to parse"),
    ("/v1/completions", b'{"prompt": "\x80"}', 400, "Failed to parse"),
    ("/tokenize", b'{"inputs": "\xf8\x88\x80\x80\x80"}', 400, "Failed to parse"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": 1e400}}', 422, "Failed to deserialize"),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": 1e400}}', 422, "Failed to deserialize"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": %d}}' % 2**70, 422, "Failed to deserialize"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_k": %d}}' % 2**70, 422, "Failed to deserialize"),
    ("/generate", b'{"inputs": "hi", "parameters": {"seed": %d}}' % 2**70, 422, "expected u64"),
    ("/generate", b'{"inputs": "hi", "parameters": {"truncate": %d}}' % 2**64, 422, "expected u64"),
    ("/generate", b'{"inputs": "hi", "parameters": {"best_of": %d}}' % 2**70, 422, "expected u64"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": 1.5}}', 422, "Failed to deserialize"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": %d}' % 2**70, 422, "Failed to deserialize"),
    ("/v1/chat/completions", b'{"messages": [{"role":"user","content":"hi"}], "max_tokens": 1e400}', 422, "Failed"),
    # deeply nested JSON: TGI's serde_json stops at 128 levels with a 400; we must not crash either decoder
    ("/generate", b'{"inputs": "hi", "x": ' + nested(DEEP) + b"}", 400, "recursion limit exceeded"),
    ("/generate", b'{"a":' * DEEP + b"1" + b"}" * DEEP, 400, "recursion limit exceeded"),
    ("/generate", nested(DEEP), (400, 422), ""),
    ("/generate_stream", b'{"inputs": "hi", "x": ' + nested(DEEP) + b"}", 400, "recursion limit exceeded"),
    ("/", b'{"inputs": "hi", "x": ' + nested(DEEP) + b"}", 400, "recursion limit exceeded"),
    ("/invocations", b'{"inputs": "hi", "x": ' + nested(DEEP) + b"}", 400, ""),
    ("/tokenize", b'{"inputs": "hi", "x": ' + nested(DEEP) + b"}", 400, ""),
    ("/chat_tokenize", b'{"messages": [], "x": ' + nested(DEEP) + b"}", 400, ""),
    ("/v1/chat/completions", b'{"messages": [], "x": ' + nested(DEEP) + b"}", 400, ""),
    ("/v1/completions", b'{"prompt": "hi", "x": ' + nested(DEEP, b'{"a":', b"}") + b"}", 400, ""),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + nested(DEEP) + b"}]}", (400, 422), ""),
    # not JSON at all, or not an object
    ("/generate", b"", 400, "Failed to parse"),
    ("/generate", b"null", 422, "Failed to deserialize"),
    ("/generate", b'"inputs"', 422, "Failed to deserialize"),
    ("/v1/chat/completions", b"[]", 422, "Failed to deserialize"),
    ("/generate", b"\x00\x00\x00", 400, "Failed to parse"),
    # chat messages and tools travel as sent: an int msgpack cannot hold is refused, not a 500
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "x": %d}]}' % 2**70, 422, "Failed"),
    ("/invocations", b'{"messages": [{"role": "user", "content": "hi", "x": %d}]}' % -(2**70), 422, "Failed"),
]


@pytest.mark.parametrize(
    "path,body,status,fragment", BAD_BODIES, ids=lambda v: repr(v)[:40] if isinstance(v, bytes) else None
)
def test_bad_bodies_get_a_json_error(tiny_server, path, body, status, fragment):
    r = requests.post(tiny_server.url + path, data=body, headers=JSON, timeout=60)
    assert_error(r, status, fragment)
    assert requests.get(tiny_server.url + "/health", timeout=10).status_code == 200


def test_ten_megabyte_body_is_a_413(tiny_server):
    body = json.dumps({"inputs": "a" * 10_000_000}).encode()
    r = requests.post(tiny_server.url + "/generate", data=body, headers=JSON, timeout=60)
    assert_error(r, 413, "length limit exceeded")
    chunks = iter([body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)])  # no Content-Length
    try:
        r = requests.post(tiny_server.url + "/v1/completions", data=chunks, headers=JSON, timeout=60)
        assert_error(r, 413, "length limit exceeded")
    except requests.ConnectionError:
        pass  # the server may answer and close before the client has sent every chunk
    assert_served(tiny_server.url)


def test_nulls_everywhere(tiny_server):
    """Every field null, on every generation route: a 200 where TGI's type is an Option, else a JSON 422."""
    url = tiny_server.url
    params = {
        "best_of": None,
        "temperature": None,
        "repetition_penalty": None,
        "frequency_penalty": None,
        "top_k": None,
        "top_p": None,
        "typical_p": None,
        "max_new_tokens": 2,
        "return_full_text": None,
        "truncate": None,
        "seed": None,
        "top_n_tokens": None,
        "grammar": None,
        "adapter_id": None,
    }
    assert requests.post(url + "/generate", json={"inputs": "hi", "parameters": params}, timeout=60).status_code == 200
    for key in ("do_sample", "stop", "details", "watermark", "decoder_input_details"):
        r = requests.post(url + "/generate", json={"inputs": "hi", "parameters": {**params, key: None}}, timeout=60)
        assert_error(r, 422, "Failed to deserialize")
    for path, body in [
        ("/generate", {"inputs": None}),
        ("/generate", {"inputs": "hi", "parameters": None}),
        ("/", {"inputs": "hi", "stream": None}),
        ("/v1/completions", {"prompt": None}),
        ("/v1/chat/completions", {"messages": None}),
        ("/v1/chat/completions", {"messages": [{"role": None, "content": None}]}),
        ("/tokenize", {"inputs": None}),
    ]:
        assert_error(requests.post(url + path, json=body, timeout=60), 422)
    chat_nulls = {"model": None, "max_tokens": 2, "temperature": None, "top_p": None, "seed": None, "stop": None}
    chat_nulls |= {"frequency_penalty": None, "presence_penalty": None, "logprobs": None, "top_logprobs": None}
    chat_nulls |= {"tools": None, "tool_choice": None, "response_format": None, "stream": None}
    r = requests.post(url + "/v1/chat/completions", json={"messages": CHAT, **chat_nulls}, timeout=60)
    assert r.status_code in (200, 422), r.text
    if r.status_code == 422:
        assert_error(r, 422)
    assert_served(url)


def test_unknown_fields_are_ignored(tiny_server):
    url = tiny_server.url
    extra = {"unknown": {"deep": [1, 2, {"x": None}]}, "__proto__": {"polluted": True}, "": 1, "é🚀": "x"}
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2, **extra}, **extra}
    assert requests.post(url + "/generate", json=body, timeout=60).status_code == 200
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    assert requests.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_control_characters_in_inputs_and_stop_sequences(tiny_server):
    url = tiny_server.url
    weird = "a\x00b\x01\x1b[31m\r\n\u2028\u202e\ufeff\U0010ffff end"
    params = {"max_new_tokens": 3, "stop": ["\x00", "\x1b", "\n\r"], "details": True}
    r = requests.post(url + "/generate", json={"inputs": weird, "parameters": params}, timeout=60)
    assert r.status_code == 200, r.text
    r = requests.post(url + "/generate_stream", json={"inputs": weird, "parameters": params}, timeout=60)
    events = sse_events(r.content)
    assert r.status_code == 200 and events and "generated_text" in events[-1], r.text
    r = requests.post(url + "/tokenize", json={"inputs": weird}, timeout=60)
    assert r.status_code == 200 and r.json(), r.text
    chat = {"messages": [{"role": "user", "content": weird}], "max_tokens": 3, "stop": ["\x00"]}
    r = requests.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert_served(url)


def test_a_thousand_stop_sequences(tiny_server):
    stops = [f"stop{i}\x00" for i in range(1000)]
    for path, body in [
        ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop": stops}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": stops}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stop": stops}),
    ]:
        r = requests.post(tiny_server.url + path, json=body, timeout=60)
        assert_error(r, 422, "`stop` supports up to 4 stop sequences. Given: 1000")
    huge = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop": ["x" * 500_000]}}
    assert requests.post(tiny_server.url + "/generate", json=huge, timeout=60).status_code == 200
    assert_served(tiny_server.url)


# --------------------------------------------------------------------------------------------
# schemathesis: generated requests (valid and invalid) for every operation of our OpenAPI document

FIVE_XX_ALLOWED = {("incomplete_generation", 500)}  # TGI's documented 5xx that a healthy server may send
SMALL = 3  # generated token counts are capped here so the run stays fast


def _cap(body):
    """Keep generation short: a generated max_new_tokens / max_tokens / max_output_tokens / n / best_of is capped (or
    set), in each of /vertex's instances too."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("instances"), list):
        body["instances"] = [_cap(instance) for instance in body["instances"]]
    params = body.get("parameters")
    if isinstance(params, dict):
        for key in ("max_new_tokens", "best_of"):
            if isinstance(params.get(key), int) and not isinstance(params.get(key), bool) and params[key] > SMALL:
                params[key] = SMALL
        params.setdefault("max_new_tokens", SMALL)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > SMALL:
            body[key] = SMALL
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", SMALL)
    elif "input" in body:  # the Responses API
        body.setdefault("max_output_tokens", SMALL)
    elif "inputs" in body and "parameters" not in body:
        body["parameters"] = {"max_new_tokens": SMALL, "do_sample": True}  # what an omitted object means, capped
    return body


def _operations(doc: dict):
    import schemathesis

    schema = schemathesis.openapi.from_dict(doc)
    return [result.ok() for result in schema.get_all_operations()]


def test_schemathesis_fuzz(tiny_server):
    from schemathesis import GenerationMode

    url = tiny_server.url
    doc = requests.get(url + "/api-doc/openapi.json", timeout=10).json()
    session = requests.Session()
    seen: dict[str, int] = {}

    def check(case) -> None:
        if isinstance(case.body, dict | list):
            case.body = _cap(case.body)
        response = case.call(base_url=url, session=session, timeout=60)
        status = response.status_code
        key = f"{case.method} {case.path} {status}"
        seen[key] = seen.get(key, 0) + 1
        if status < 400 or case.path in ("/health", "/ping", "/") and case.method == "GET" and status == 503:
            return
        ctype = response.headers.get("content-type") or response.headers.get("Content-Type") or [""]
        ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis' Response: a list per header
        assert ctype.startswith("application/json"), (key, response.text[:200])
        body = response.json()
        if case.path.startswith(("/v1/responses", "/v1/messages")):  # OpenAI's / Anthropic's own error shapes
            layer = isinstance(body.get("error"), str)  # the middlewares' (413, a body too deep) stay TGI's
            shaped = isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)
            assert layer or shaped, (key, body)
            assert case.path.startswith("/v1/responses") or layer or body.get("type") == "error", (key, body)
            assert status < 500, (key, body, case.body)
            return
        if case.path in ADAPTER_ROUTES:  # vLLM's routes answer in vLLM's error shape, so its tooling works unchanged
            assert body.get("object") == "error" and isinstance(body.get("message"), str), (key, body)
            assert status < 500, (key, body, case.body)
            return
        if (case.path.startswith("/v1/") or case.path == "/invocations") and isinstance(body.get("error"), dict):
            # OpenAI's routes refuse some things in OpenAI's shape (an unknown model: 404 model_not_found), which
            # its SDKs read; /invocations hands chat and completion bodies to them, and answers as they do
            err = body["error"]
            assert isinstance(err.get("message"), str) and isinstance(err.get("code"), str), (key, body)
            assert status < 500, (key, body, case.body)
            return
        assert isinstance(body, dict) and isinstance(body.get("error"), str), (key, body)
        assert isinstance(body.get("error_type"), str), (key, body)
        if status >= 500:
            assert (body["error_type"], status) in FIVE_XX_ALLOWED, (key, body, case.body)

    for op in _operations(doc):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            examples = 30 if op.method.upper() == "POST" else 5
            if op.path == "/vertex":  # arrays of whole /generate bodies: each draw costs ten of another route's
                examples = 10

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: each step is a round trip to the server
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                check(case)

            try:
                run()
            except Unsatisfiable:  # an operation without body or parameters has no invalid requests
                assert mode == GenerationMode.NEGATIVE, op.path
    assert_served(url)
    posts = {k for k in seen if k.startswith("POST")}
    assert any(k.endswith(" 200") for k in posts) and any(" 4" in k for k in posts), sorted(seen)


@given(st.binary(max_size=200))
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_random_bytes_on_every_route(tiny_server, body):
    for path in ("/generate", "/v1/chat/completions", "/invocations", "/tokenize"):
        r = requests.post(tiny_server.url + path, data=body, headers=JSON, timeout=60)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            assert_error(r, r.status_code)
