"""Every validation rule of TGI, table-driven, through the real processes: the exact message, error_type and
status; the order of the checks (a request that breaks two rules gets the earlier one's message); the same
errors in-stream (HTTP 200) on the SSE routes, OpenAI-style on /v1/…; and the server goes on serving."""

from __future__ import annotations

import json

import pytest
import requests

from tests.e2e.conftest import sse_events

pytestmark = pytest.mark.e2e

P = "Input validation error: "
FIVE_STOPS = ["a", "b", "c", "d", "e"]
LONG = "word " * 210  # 421 tokens of the tiny tokenizer ("word " is 2): more than max_input_tokens (400)
HUGE = "word " * 300  # 603 tokens: more than max_total_tokens (512)

# (inputs, parameters, message); "{n}" is the prompt's token count (tiny tokenizer, with <bos>)
RULES = [
    ("hi", {"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ("hi", {"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ("hi", {"best_of": 2, "do_sample": True, "seed": 7}, "`seed` must not be set when `best_of` > 1"),
    ("hi", {"temperature": 0.0}, "`temperature` must be strictly positive"),
    ("hi", {"temperature": -1.0}, "`temperature` must be strictly positive"),
    ("hi", {"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ("hi", {"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("hi", {"frequency_penalty": -2.1}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("hi", {"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ("hi", {"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ("hi", {"typical_p": 0.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ("hi", {"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ("hi", {"top_k": 0}, "`top_k` must be strictly positive"),
    ("hi", {"top_k": -3}, "`top_k` must be strictly positive"),
    ("hi", {"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ("hi", {"stop": FIVE_STOPS}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ("hi", {"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ("", {}, "`inputs` cannot be empty"),
    ("hi", {"truncate": 0}, "`truncate` must be strictly positive and less than 400. Given: 0"),
    ("hi", {"truncate": 401}, "`truncate` must be strictly positive and less than 400. Given: 401"),
    (
        "word " * 60,
        {"max_new_tokens": 400},
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: {n} `inputs` tokens and 400 `max_new_tokens`",
    ),
    (  # truncation happens before the length checks: the truncated length is reported
        "word " * 300,
        {"truncate": 100, "max_new_tokens": 450},
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 100 `inputs` tokens and 450 `max_new_tokens`",
    ),
    (LONG, {"max_new_tokens": 5}, "`inputs` must have less than 400 tokens. Given: {n}"),
    (LONG, {}, "`inputs` must have less than 400 tokens. Given: {n}"),  # null: what is left (91) fits
    (  # null max_new_tokens with nothing left: a chunk of 0 new tokens, still over the total
        HUGE,
        {},
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: {n} `inputs` tokens and 0 `max_new_tokens`",
    ),
    ("hi", {"grammar": {"type": "json", "value": 5}}, "grammar is not supported"),
    # the order of the checks: each request breaks two rules, the first in TGI's order wins
    ("hi", {"best_of": 3, "temperature": 0.0}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ("hi", {"best_of": 2, "top_n_tokens": 9}, "you must use sampling when `best_of` is > 1"),
    ("hi", {"temperature": 0.0, "top_p": 1.0}, "`temperature` must be strictly positive"),
    ("hi", {"repetition_penalty": 0.0, "frequency_penalty": 3.0}, "`repetition_penalty` must be strictly positive"),
    ("hi", {"frequency_penalty": 3.0, "top_p": 0.0}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("hi", {"top_p": 0.0, "typical_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ("hi", {"typical_p": 1.0, "top_k": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ("hi", {"top_k": 0, "max_new_tokens": 0}, "`top_k` must be strictly positive"),
    ("hi", {"max_new_tokens": 0, "stop": FIVE_STOPS}, "`max_new_tokens` must be strictly positive"),
    ("hi", {"stop": FIVE_STOPS, "top_n_tokens": 6}, "`stop` supports up to 4 stop sequences. Given: 5"),
    (
        "hi",
        {"best_of": 2, "do_sample": True, "seed": 1, "top_n_tokens": 6},
        "`seed` must not be set when `best_of` > 1",
    ),
    ("", {"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ("", {"truncate": 0}, "`inputs` cannot be empty"),
    (LONG, {"truncate": 0, "max_new_tokens": 5}, "`truncate` must be strictly positive and less than 400. Given: 0"),
]


def expected_message(tokenizer, inputs: str, template: str) -> str:
    return P + template.replace("{n}", str(len(tokenizer(inputs).input_ids)))


def assert_served(url: str) -> None:
    ok = requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=30)
    assert ok.status_code == 200 and "generated_text" in ok.json(), ok.text


@pytest.mark.parametrize("inputs,params,message", RULES, ids=[f"{i}:{m[:40]}" for i, (_, _, m) in enumerate(RULES)])
def test_rule_on_generate_compat_and_stream(tiny_server, tiny_tokenizer, inputs, params, message):
    want = {"error": expected_message(tiny_tokenizer, inputs, message), "error_type": "validation"}
    body = {"inputs": inputs, "parameters": params}
    r = requests.post(tiny_server.url + "/generate", json=body, timeout=30)
    assert (r.status_code, r.json()) == (422, want)
    r = requests.post(tiny_server.url + "/", json=body, timeout=30)
    assert (r.status_code, r.json()) == (422, want)
    if params.get("best_of", 1) == 1:  # best_of != 1 on a stream has its own, earlier error (below)
        for path, stream_body in (("/generate_stream", body), ("/", {**body, "stream": True})):
            r = requests.post(tiny_server.url + path, json=stream_body, timeout=30)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert sse_events(r.content) == [want], r.text  # the error, then the stream ends: no [DONE]


# stream-only rules: they come before every other check (TGI checks them before validation)
STREAM_RULES = [
    ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
    ({"best_of": 2, "top_p": 1.0}, "`best_of` != 1 is not supported when streaming tokens"),
    ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported when streaming tokens"),
    (
        {"decoder_input_details": True, "temperature": 0.0},
        "`decoder_input_details` == true is not supported when streaming tokens",
    ),
]


@pytest.mark.parametrize("params,message", STREAM_RULES)
def test_stream_only_rules(tiny_server, params, message):
    want = {"error": P + message, "error_type": "validation"}
    r = requests.post(tiny_server.url + "/generate_stream", json={"inputs": "hi", "parameters": params}, timeout=30)
    assert r.status_code == 200 and sse_events(r.content) == [want], r.text
    assert_served(tiny_server.url)


# bodies serde refuses: TGI's 422 deserialize error (in TGI's JSON error shape, README), before any validation
UNDESERIALIZABLE = [
    {"parameters": {}},  # no inputs
    {"inputs": 5},
    {"inputs": "hi", "parameters": {"stop": None}},  # bools and `stop` are not nullable
    {"inputs": "hi", "parameters": {"do_sample": None}},
    {"inputs": "hi", "parameters": {"details": None}},
    {"inputs": "hi", "parameters": {"stop": "x"}},  # a list, not a string
    {"inputs": "hi", "parameters": {"seed": -1}},  # unsigned
    {"inputs": "hi", "parameters": {"max_new_tokens": -1}},
    {"inputs": "hi", "parameters": {"top_n_tokens": -1}},
    {"inputs": "hi", "parameters": {"truncate": -1}},
    {"inputs": "hi", "parameters": {"best_of": -1}},
]


@pytest.mark.parametrize("body", UNDESERIALIZABLE, ids=[json.dumps(b)[:60] for b in UNDESERIALIZABLE])
def test_undeserializable_bodies(tiny_server, body):
    r = requests.post(tiny_server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith("Failed to deserialize the JSON body"), r.text


def test_nulls_and_unknown_fields_are_accepted(tiny_server):
    """Every Option parameter takes an explicit null (the official client sends them all), unknown keys are
    ignored, and a malformed body is a 400."""
    nullable = ["best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_k", "top_p", "typical_p"]
    nullable += ["max_new_tokens", "return_full_text", "truncate", "seed", "top_n_tokens", "grammar", "adapter_id"]
    params = {**dict.fromkeys(nullable), "max_new_tokens": 3, "made_up": 1}
    r = requests.post(tiny_server.url + "/generate", json={"inputs": "hi", "parameters": params, "x": 2}, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.post(tiny_server.url + "/generate", data=b"{oops", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("Failed to parse the request body as JSON")


CHAT = [{"role": "user", "content": "the quick brown fox"}]
# (chat body, message): TGI's mapping of OpenAI fields onto the same rules
CHAT_RULES = [
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"temperature": -0.5}, "`temperature` must be strictly positive"),
    ({"presence_penalty": -2.0}, "`repetition_penalty` must be strictly positive"),  # penalty + 2 = 0
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"logprobs": True, "top_logprobs": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"stop": FIVE_STOPS}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"max_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_completion_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_tokens": 600}, "`inputs` tokens + `max_new_tokens` must be <= 512. Given: {n} `inputs` tokens and 600"),
]


@pytest.mark.parametrize("extra,message", CHAT_RULES, ids=[m[:40] for _, m in CHAT_RULES])
def test_chat_rules(tiny_server, tiny_tokenizer, extra, message):
    rendered = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    n = len(tiny_tokenizer(rendered, add_special_tokens=False).input_ids)
    want = P + message.replace("{n}", str(n))
    body = {"model": "tgi", "messages": CHAT, **extra}
    r = requests.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error_type"] == "validation" and err["error"].startswith(want), err
    # streaming: HTTP 200, then OpenAI's error event and [DONE]
    r = requests.post(tiny_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert len(events) == 2 and events[1] == "[DONE]", events
    assert events[0]["error"]["http_status_code"] == 422 and events[0]["error"]["message"].startswith(want)


def test_completions_rules(tiny_server):
    url = tiny_server.url + "/v1/completions"
    r = requests.post(url, json={"prompt": "hi", "suffix": "there"}, timeout=30)
    assert (r.status_code, r.json()) == (
        422,
        {
            "error": "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "error_type": "suffix not supported",
        },
    )
    r = requests.post(url, json={"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}, timeout=30)
    assert (r.status_code, r.json()) == (
        422,
        {"error": "Number of prompts exceeds the maximum allowed batch size of 4", "error_type": "batch size exceeded"},
    )
    r = requests.post(url, json={"prompt": []}, timeout=30)
    assert r.status_code == 422 and "Empty array detected" in r.json()["error"], r.text
    r = requests.post(url, json={"prompt": "hi", "top_p": 1.0}, timeout=30)
    assert (r.status_code, r.json()) == (
        422,
        {"error": P + "`top_p` must be > 0.0 and < 1.0", "error_type": "validation"},
    )
    r = requests.post(url, json={"prompt": "hi", "top_p": 1.0, "stream": True}, timeout=30)
    assert r.status_code == 200
    assert sse_events(r.content) == [
        {"error": {"message": P + "`top_p` must be > 0.0 and < 1.0", "http_status_code": 422}},
        "[DONE]",
    ]


def test_an_invalid_response_format_is_a_clear_422(tiny_server):
    """A schema that is not one is refused with TGI's message before anything runs (tests/e2e/test_structured_output.py
    has the rest of structured output)."""
    body = {"messages": CHAT, "response_format": {"type": "json", "value": {"type": "nonsense"}}}
    r = requests.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["error"].startswith(P + "grammar is not valid: "), r.text
    assert_served(tiny_server.url)


def test_an_image_to_a_text_only_model(tiny_server):
    """An OpenAI image part is refused with TGI's 422 before anything runs (chat, its stream, /chat_tokenize); a
    markdown image in `inputs` stays text, as TGI reads it on a model without a vision tower (/generate's prefill
    and /tokenize count the same tokens)."""
    url, picture = tiny_server.url, "https://example.com/cat.png"
    parts = [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": picture}}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    want = P + "this model does not take images"
    for path in ("/v1/chat/completions", "/chat_tokenize"):
        r = requests.post(url + path, json=body, timeout=30)
        assert r.status_code == 422 and r.json()["error_type"] == "validation", (path, r.text)
        assert r.json()["error"].startswith(want), (path, r.text)
    events = sse_events(requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30).content)
    assert events[0]["error"]["http_status_code"] == 422 and events[0]["error"]["message"].startswith(want)
    inputs = f"what is ![]({picture})"
    params = {"max_new_tokens": 2, "details": True, "decoder_input_details": True}
    r = requests.post(url + "/generate", json={"inputs": inputs, "parameters": params}, timeout=30)
    assert r.status_code == 200, r.text
    tokens = requests.post(url + "/tokenize", json={"inputs": inputs}, timeout=30).json()
    assert [t["id"] for t in r.json()["details"]["prefill"]] == [t["id"] for t in tokens]
    assert tokens[-1]["stop"] == len(inputs.encode())  # the markdown image's text, to its last byte
