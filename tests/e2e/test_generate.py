"""End to end through the six real processes on a tiny model: greedy output equals transformers'
generate() token for token, streams add up, requests join a running batch, bad input is refused."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
import requests
from text_generation import Client
from transformers import AutoTokenizer

from tests.e2e.conftest import fresh_metrics
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()


def prompt(i: int) -> str:
    """Prompts of different lengths, 3 to ~60 words."""
    n = 3 + (i * 7) % 60
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def generate(session, url, text, max_new, stream):
    body = {"inputs": text, "parameters": {"max_new_tokens": max_new, "details": True}}
    if not stream:
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
            return [t["id"] for t in out["details"]["tokens"]], out["generated_text"], None
    events = []
    async with session.post(url + "/generate_stream", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    final = events[-1]
    assert final["generated_text"] is not None and all(e["generated_text"] is None for e in events[:-1])
    assert final["details"]["generated_tokens"] == len(events)
    return [e["token"]["id"] for e in events], final["generated_text"], events


def test_concurrent_greedy_equals_transformers(tiny_server, tiny_model_dir, tokenizer):
    cases = [(prompt(i), 4 + (i * 5) % 29, i % 2 == 1) for i in range(16)]

    async def run_all():
        async with aiohttp.ClientSession() as session:
            jobs = [generate(session, tiny_server.url, text, n, stream) for text, n, stream in cases]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    for (text, max_new, stream), (ids, generated_text, events) in zip(cases, results):
        expected = reference_generate(tiny_model_dir, tokenizer(text).input_ids, max_new)
        assert ids == expected, f"prompt {text!r}"
        # a random model emits invalid UTF-8 byte runs: Switchyard drops those bytes instead of U+FFFD
        assert generated_text == tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")
        if stream:  # the streamed deltas add up to the final text (special tokens aside)
            assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == generated_text


def test_official_client(tiny_server, tiny_model_dir, tokenizer):
    client = Client(tiny_server.url, timeout=60)
    text = prompt(5)
    expected = reference_generate(tiny_model_dir, tokenizer(text).input_ids, 12)
    response = client.generate(text, max_new_tokens=12)
    assert [t.id for t in response.details.tokens] == expected
    assert response.generated_text == tokenizer.decode(expected, skip_special_tokens=True).replace("\ufffd", "")
    assert response.details.finish_reason in ("length", "eos_token")
    streamed = list(client.generate_stream(text, max_new_tokens=12))
    assert [r.token.id for r in streamed] == expected
    assert streamed[-1].generated_text == response.generated_text
    # POST / answers a JSON list, and defaults return_full_text to true like TGI's compat route
    raw = requests.post(tiny_server.url + "/", json={"inputs": text, "parameters": {"max_new_tokens": 12}}).json()
    assert isinstance(raw, list) and raw[0]["generated_text"] == text + response.generated_text


def counter_in(text: str, name: str) -> int:
    m = re.search(rf'^switchyard_scheduler_{name}_total{{index="0"}} (\d+)$', text, re.M)
    assert m, text
    return int(m.group(1))


def scheduler_counter(url: str, name: str) -> int:
    """A scheduler counter as rendered after this call began: every earlier request counted."""
    return counter_in(fresh_metrics(url, ("scheduler",)), name)


def counter_now(url: str, name: str) -> int:
    """A scheduler counter as its last heartbeat brought it (for polls: cheap, perhaps a render behind)."""
    return counter_in(requests.get(url + "/metrics", timeout=10).text, name)


def counter_rises(url: str, name: str, above: int, within: float = 30.0) -> bool:
    """Counters travel in heartbeats (one a second, later on a loaded machine): wait for one fresh enough."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if counter_now(url, name) > above:
            return True
        time.sleep(0.2)
    return False


def test_request_joins_running_batch(tiny_server, tiny_model_dir, tokenizer):
    """B arrives while A is mid-generation: B's prefill runs in a step with A's decode (scheduler's counter)."""
    joined_before = scheduler_counter(tiny_server.url, "joined_steps")
    a_text, b_text = prompt(20), prompt(21)

    async def scenario():
        async with aiohttp.ClientSession() as session:
            body = {"inputs": a_text, "parameters": {"max_new_tokens": 200, "details": True}}
            a_ids, b_task = [], None
            async with session.post(tiny_server.url + "/generate_stream", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        a_ids.append(json.loads(line[6:])["token"]["id"])
                        if len(a_ids) == 3:  # A is decoding now
                            b_task = asyncio.create_task(generate(session, tiny_server.url, b_text, 8, False))
                return a_ids, await b_task

    a_ids, (b_ids, _, _) = asyncio.run(scenario())
    assert a_ids == reference_generate(tiny_model_dir, tokenizer(a_text).input_ids, 200)
    assert b_ids == reference_generate(tiny_model_dir, tokenizer(b_text).input_ids, 8)
    assert counter_rises(tiny_server.url, "joined_steps", joined_before)


BAD_INPUT = [
    # (body, status, error_type, message fragment)
    (b"{not json", 400, "validation", "Failed to parse the request body as JSON"),
    (b'{"inputs": 5}', 422, "validation", "Failed to deserialize the JSON body"),
    (b'{"inputs": ""}', 422, "validation", "Input validation error: `inputs` cannot be empty"),
    (
        json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": -1}}).encode(),
        422,
        "validation",
        "Failed to deserialize the JSON body",
    ),
    (
        json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 0}}).encode(),
        422,
        "validation",
        "Input validation error: `max_new_tokens` must be strictly positive",
    ),
    (
        json.dumps({"inputs": "hi", "parameters": {"top_p": 1.0}}).encode(),
        422,
        "validation",
        "Input validation error: `top_p` must be > 0.0 and < 1.0",
    ),
    (
        json.dumps({"inputs": "word " * 210, "parameters": {"max_new_tokens": 5}}).encode(),
        422,
        "validation",
        "Input validation error: `inputs` must have less than 400 tokens. Given: ",
    ),
    (
        json.dumps({"inputs": "word " * 150, "parameters": {"max_new_tokens": 300}}).encode(),
        422,
        "validation",
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 512. Given: ",
    ),
]


@pytest.mark.parametrize("body,status,error_type,fragment", BAD_INPUT)
def test_bad_input_gets_tgi_error_and_server_goes_on(tiny_server, body, status, error_type, fragment):
    headers = {"Content-Type": "application/json"}
    r = requests.post(tiny_server.url + "/generate", data=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["error_type"] == error_type and err["error"].startswith(fragment), err
    # the stream route answers 200 and reports the same error in-stream (TGI)
    if status == 422 and b"Input validation" in fragment.encode():
        r = requests.post(tiny_server.url + "/generate_stream", data=body, headers=headers)
        assert r.status_code == 200
        event = json.loads(r.text.strip().removeprefix("data: "))
        assert event == err
    ok = requests.post(tiny_server.url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and "generated_text" in ok.json()


def test_info_and_health(tiny_server, tiny_model_dir):
    assert requests.get(tiny_server.url + "/health").status_code == 200
    info = requests.get(tiny_server.url + "/info").json()
    assert info["model_id"] == str(tiny_model_dir)
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (400, 512)


def test_stop_sequence_ends_the_request(tiny_server, tiny_model_dir, tokenizer):
    text = prompt(9)
    expected = reference_generate(tiny_model_dir, tokenizer(text).input_ids, 20)
    full = requests.post(
        tiny_server.url + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": 20, "details": True}}
    ).json()
    # a stop string that spans the boundary between token k-1 and token k, first seen there
    texts = [t["text"] for t in full["details"]["tokens"]]
    assert [t["id"] for t in full["details"]["tokens"]] == expected
    joined = "".join(texts)
    k, stop = next(
        (k, texts[k - 1][-1] + texts[k][0])
        for k in range(2, len(texts))
        if texts[k - 1] and texts[k] and joined.find(texts[k - 1][-1] + texts[k][0]) == len("".join(texts[:k])) - 1
    )
    params = {"max_new_tokens": 20, "details": True, "stop": [stop]}
    out = requests.post(tiny_server.url + "/generate", json={"inputs": text, "parameters": params}).json()
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["details"]["generated_tokens"] == k + 1
    assert [t["id"] for t in out["details"]["tokens"]] == expected[: k + 1]
    assert stop in out["generated_text"]
    # the scheduler frees a stopped request at once: a follow-up is served normally
    assert requests.post(tiny_server.url + "/generate", json={"inputs": "a", "parameters": {}}).status_code == 200


def test_seeded_sampling_repeats(tiny_server):
    params = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 1234}
    body = {"inputs": prompt(3), "parameters": {**params, "details": True}}
    first = requests.post(tiny_server.url + "/generate", json=body).json()
    again = requests.post(tiny_server.url + "/generate", json=body).json()
    assert first["details"]["seed"] == 1234
    assert [t["id"] for t in first["details"]["tokens"]] == [t["id"] for t in again["details"]["tokens"]]
    other = requests.post(
        tiny_server.url + "/generate", json={**body, "parameters": {**body["parameters"], "seed": 99}}
    )
    assert [t["id"] for t in other.json()["details"]["tokens"]] != [t["id"] for t in first["details"]["tokens"]]


def scheduler_gauges(text: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r'^switchyard_replica_(\w+)\{replica="0"\} (\d+)$', text, re.M)}


def test_client_disconnect_aborts_and_frees_kv(tiny_server):
    # a prompt that, undisturbed, runs the whole 400 tokens (no EOS on the way)
    def full_length(text):
        body = {"inputs": text, "parameters": {"max_new_tokens": 400, "details": True}}
        return requests.post(tiny_server.url + "/generate", json=body).json()["details"]["finish_reason"] == "length"

    text = next(t for t in (prompt(i) for i in range(40)) if full_length(t))
    generated_before = scheduler_counter(tiny_server.url, "generated")
    body = {"inputs": text, "parameters": {"max_new_tokens": 400}}
    with requests.post(tiny_server.url + "/generate_stream", json=body, stream=True) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith(b"data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-generation
    # the abort reaches the scheduler a moment later: wait for a render that shows nothing running any more
    deadline = time.monotonic() + 30
    while True:
        text = fresh_metrics(tiny_server.url, ("scheduler",))
        g, generated = scheduler_gauges(text), counter_in(text, "generated")
        if g["batch_current_size"] == 0 or time.monotonic() > deadline:
            break
    assert g["batch_current_size"] == 0 and g["kv_blocks_free"] == g["kv_blocks_total"], g
    assert generated - generated_before < 400  # stopped early: aborted, not run to the end
