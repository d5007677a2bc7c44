"""`n` choices on /v1/completions and /v1/chat/completions through the real processes on the tiny model: with
temperature 0 every choice is transformers' greedy answer (float32, eager), a seeded request gives the same n
answers again, streaming interleaves the choices by index, usage counts the prompt once and every choice's tokens;
the prompt is prefilled once (the scheduler's sibling_shared_tokens counter), also after a prefix-cache hit and under
preemption; n out of range is a 422 and the server keeps serving."""

from __future__ import annotations

import json

import pytest
import requests

from tests.e2e.conftest import fresh_metrics
from tests.e2e.test_generate import counter_in, counter_rises, prompt, scheduler_counter
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

BLOCK = 16


def text(tokenizer, ids: list[int]) -> str:
    """The ids' text as the server writes it: special tokens and incomplete UTF-8 left out."""
    return tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")


def post(url: str, route: str, body: dict) -> dict:
    r = requests.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def events(url: str, route: str, body: dict) -> list[dict]:
    r = requests.post(url + route, json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    out = []
    for line in r.iter_lines():
        if line.startswith(b"data:") and line != b"data: [DONE]":
            out.append(json.loads(line[5:]))
    return out


def shared_prompt(tokenizer, words: int = 45) -> tuple[str, list[int]]:
    p = prompt(words)
    ids = tokenizer(p).input_ids
    assert len(ids) > 2 * BLOCK  # full blocks to share
    return p, ids


def test_greedy_n_equals_greedy_and_the_prompt_is_prefilled_once(tiny_server, tiny_model_dir, tiny_tokenizer):
    p, ids = shared_prompt(tiny_tokenizer)
    want = reference_generate(tiny_model_dir, ids, 8)
    shared_before = scheduler_counter(tiny_server.url, "sibling_shared_tokens")
    out = post(tiny_server.url, "/v1/completions", {"prompt": p, "n": 4, "temperature": 0, "max_tokens": 8})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == text(tiny_tokenizer, want) for c in out["choices"])
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 4 * len(want),
        "total_tokens": len(ids) + 4 * len(want),
    }
    # three siblings took the first one's full prompt blocks instead of computing them
    full = (len(ids) - 1) // BLOCK * BLOCK
    assert counter_rises(tiny_server.url, "sibling_shared_tokens", shared_before + 3 * full - 1)


def test_n_after_a_prefix_hit(tiny_server, tiny_model_dir, tiny_tokenizer):
    p, ids = shared_prompt(tiny_tokenizer, 17)
    messages = [{"role": "user", "content": p}]
    post(tiny_server.url, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 2})
    metrics = fresh_metrics(tiny_server.url, ("scheduler",))
    hits, shared = counter_in(metrics, "prefix_hit_tokens"), counter_in(metrics, "sibling_shared_tokens")
    body = {"messages": messages, "temperature": 0, "max_tokens": 6, "n": 3}
    out = post(tiny_server.url, "/v1/chat/completions", body)
    answers = [c["message"]["content"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and len(set(answers)) == 1
    one = post(tiny_server.url, "/v1/chat/completions", {**body, "n": 1})
    assert answers[0] == one["choices"][0]["message"]["content"]
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert counter_rises(tiny_server.url, "prefix_hit_tokens", hits)
    assert counter_rises(tiny_server.url, "sibling_shared_tokens", shared)


def test_seeded_n_repeats_and_its_first_choice_is_the_seeds_own(tiny_server, tiny_tokenizer):
    p, _ = shared_prompt(tiny_tokenizer)
    body = {"messages": [{"role": "user", "content": p}], "seed": 7, "temperature": 1.0, "max_tokens": 12, "n": 3}
    first = [c["message"]["content"] for c in post(tiny_server.url, "/v1/chat/completions", body)["choices"]]
    again = [c["message"]["content"] for c in post(tiny_server.url, "/v1/chat/completions", body)["choices"]]
    assert first == again
    assert len(set(first)) > 1  # each choice its own derived seed
    alone = post(tiny_server.url, "/v1/chat/completions", {**body, "n": 1})["choices"][0]["message"]["content"]
    assert alone == first[0]
    body = {"prompt": p, "seed": 11, "temperature": 1.0, "max_tokens": 12, "n": 2}
    texts = [c["text"] for c in post(tiny_server.url, "/v1/completions", body)["choices"]]
    assert texts == [c["text"] for c in post(tiny_server.url, "/v1/completions", body)["choices"]]


def test_streaming_interleaves_choices_by_index(tiny_server, tiny_model_dir, tiny_tokenizer):
    p, ids = shared_prompt(tiny_tokenizer)
    want = text(tiny_tokenizer, reference_generate(tiny_model_dir, ids, 6))
    body = {"prompt": [p, p[:-5]], "n": 3, "temperature": 0, "max_tokens": 6}
    chunks = events(tiny_server.url, "/v1/completions", body)
    by_index: dict[int, str] = {}
    ended = set()
    for c in chunks:
        (choice,) = c["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            ended.add(choice["index"])
    assert sorted(by_index) == list(range(6)) and ended == set(range(6))
    assert [by_index[i] for i in range(3)] == [want] * 3  # the first prompt's three choices
    assert len({by_index[i] for i in range(3, 6)}) == 1
    body = {
        "messages": [{"role": "user", "content": p}],
        "n": 2,
        "temperature": 0,
        "max_tokens": 5,
        "stream_options": {"include_usage": True},
    }
    chunks = events(tiny_server.url, "/v1/chat/completions", body)
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and chunks[-1] is usage[0]
    indices = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert set(indices) == {0, 1}
    texts = [
        "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
        for i in (0, 1)
    ]
    assert texts[0] == texts[1]
    assert usage[0]["usage"]["completion_tokens"] == 2 * (len(indices) // 2)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_out_of_range_is_a_422_and_the_server_keeps_serving(tiny_server, route):
    body = {"prompt": "hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    for n, message in ((0, "n must be at least 1, got 0."), (129, "n must be at most 128, got 129.")):
        r = requests.post(tiny_server.url + route, json={**body, "n": n, "max_tokens": 2}, timeout=60)
        assert r.status_code == 422, r.text
        assert r.json() == {"error": message, "error_type": "validation"}
    r = requests.post(tiny_server.url + route, json={**body, "n": 2, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_n_under_preemption_keeps_greedy_output(pressed_server, tiny_model_dir, tiny_tokenizer):
    # 20 blocks of 16: six choices of 36 + 60 tokens need 2 shared blocks and 4 of their own each
    p = prompt(45)
    ids = tiny_tokenizer(p).input_ids
    assert 2 * BLOCK < len(ids) <= 100
    want = text(tiny_tokenizer, reference_generate(tiny_model_dir, ids, 60))
    metrics = fresh_metrics(pressed_server.url, ("scheduler",))
    preempted, shared = counter_in(metrics, "preemptions"), counter_in(metrics, "sibling_shared_tokens")
    body = {"prompt": p, "n": 6, "temperature": 0, "max_tokens": 60}
    out = post(pressed_server.url, "/v1/completions", body)
    assert [c["text"] for c in out["choices"]] == [want] * 6
    assert counter_rises(pressed_server.url, "preemptions", preempted)
    assert counter_rises(pressed_server.url, "sibling_shared_tokens", shared)
