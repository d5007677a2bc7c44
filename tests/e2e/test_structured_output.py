"""Structured output end to end, on the tiny random-weight model (its unconstrained output is garbage, so every
valid answer below is the grammar's doing): JSON schemas, regexes, GBNF and tool calls mixed with unconstrained
rows in the same batches, through /generate, /generate_stream and both OpenAI routes; a request preempted
mid-JSON; streamed tool calls; the official clients; and the bad inputs, each a 422 in TGI's shape."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import jsonschema
import pytest
import requests

from tests.e2e.conftest import sse_events
from tests.e2e.server import Server
from tests.e2e.test_generate import counter_rises, prompt, scheduler_counter

pytestmark = pytest.mark.e2e

P = "Input validation error: "
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 10, "maximum": 99},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6}, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "note": {"type": "string", "maxLength": 4},  # optional
        },
        "required": ["id", "owner", "score"],
    },
    "array_enum": {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 1, "maxItems": 4},
    "ref": {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "path": {"type": "array", "items": {"$ref": "#/$defs/pt"}}},
        "required": ["a"],
    },
    "enum": {"enum": ["yes", "no", 42]},
}
REGEX = r"[0-9]{3}-[a-z]{2,5}( ok)?"
GBNF = 'root ::= "{" ws "\\"answer\\":" ws [0-9] [0-9]? ws "}"\nws ::= [ ]?'
GBNF_RE = r'\{ ?"answer": ?[0-9]{1,2} ?\}'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
TOOL_PROMPT = "Call a tool."
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def check_call(call: dict) -> None:
    assert call["type"] == "function" and call["function"]["name"] in TOOL_PARAMS
    check_json(call["function"]["arguments"], TOOL_PARAMS[call["function"]["name"]])


# ---- one request of each kind: (route, body, check of the answer) ---------------------------------------------
def generate_case(i: int) -> tuple[str, dict, object]:
    kind = i % 8
    sampled = {"do_sample": True, "temperature": 1.3, "seed": i} if i % 3 == 0 else {}
    params = {"max_new_tokens": 160, "details": True, **sampled}
    text = prompt(i % 9)[: 40 + i % 30]
    if kind < 4:
        name = list(SCHEMAS)[kind]
        params["grammar"] = {"type": "json", "value": SCHEMAS[name]}
        return "json", {"inputs": text, "parameters": params}, lambda out: check_json(out, SCHEMAS[name])
    if kind == 4:
        params["grammar"] = {"type": "regex", "value": REGEX}
        return "regex", {"inputs": text, "parameters": params}, lambda out: re.fullmatch(REGEX, out) or 1 / 0
    if kind == 5:
        params["grammar"] = GBNF  # a bare string: GBNF (beyond TGI)
        return "gbnf", {"inputs": text, "parameters": params}, lambda out: re.fullmatch(GBNF_RE, out) or 1 / 0
    params["max_new_tokens"] = 20
    return "none", {"inputs": text, "parameters": params}, None


async def post_generate(session, url: str, body: dict, stream: bool) -> tuple[str, str]:
    """(generated_text, finish_reason), through /generate or /generate_stream (whose tokens must add up)."""
    if not stream:
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
            return out["generated_text"], out["details"]["finish_reason"]
    async with session.post(url + "/generate_stream", json=body) as r:
        assert r.status == 200, await r.text()
        events = sse_events(await r.read())
    final = events[-1]
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == final["generated_text"]
    return final["generated_text"], final["details"]["finish_reason"]


async def post_chat(session, url: str, body: dict) -> dict:
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def one(session, url: str, i: int) -> str:
    """Request i of the mix; its kind when its answer is valid (an assertion error otherwise)."""
    route = i % 4
    if route in (0, 1):  # /generate, /generate_stream
        kind, body, check = generate_case(i // 4 * 2 + route)  # every kind on both routes
        text, finish = await post_generate(session, url, body, stream=route == 1)
        if check is not None:
            assert finish == "eos_token", (kind, text)  # the grammar completed, then only EOS could follow
            check(text)
        return kind
    name = list(SCHEMAS)[i % 4]
    messages = [{"role": "user", "content": prompt(i % 9)[:60]}]
    if route == 2 and i % 8 == 2:  # chat with tools, forced
        body = {"messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "seed": i}
        body["tool_prompt"] = TOOL_PROMPT  # TGI's default is long for the tiny tokenizer's 400-token inputs
        out = await post_chat(session, url, body)
        message = out["choices"][0]["message"]
        assert "content" not in message and len(message["tool_calls"]) == 1
        check_call(message["tool_calls"][0])
        return "tools"
    if route == 2:  # chat, OpenAI's json_schema shape
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        out = await post_chat(session, url, {"messages": messages, "response_format": fmt, "max_tokens": 160})
        assert out["choices"][0]["finish_reason"] == "stop"
        check_json(out["choices"][0]["message"]["content"], SCHEMAS[name])
        return "chat_json"
    body = {
        "prompt": prompt(i % 9)[:50],
        "max_tokens": 160,
        "response_format": {"type": "json", "value": SCHEMAS[name]},
    }
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    assert out["choices"][0]["finish_reason"] == "stop"
    check_json(out["choices"][0]["text"], SCHEMAS[name])
    return "completion_json"


def test_a_concurrent_mix_is_valid_by_construction(tiny_server):
    url = tiny_server.url
    before = scheduler_counter(url, "constrained_rows")

    async def run():
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(one(session, url, i) for i in range(128)))

    kinds = asyncio.run(run())
    assert {"json", "regex", "gbnf", "none", "tools", "chat_json", "completion_json"} <= set(kinds)
    assert counter_rises(url, "constrained_rows", before + 100)  # rows were masked, in shared batches
    # the tokenizer's histogram travels in its heartbeats, which lag on a loaded machine: poll for it
    compiled = re.compile(r'^switchyard_grammar_compile_seconds_count\{kind="json"\} [1-9]', re.M)
    deadline = time.monotonic() + 30
    while not compiled.search(metrics := requests.get(url + "/metrics", timeout=10).text):
        assert time.monotonic() < deadline, metrics
        time.sleep(0.2)
    # the shard compiled each grammar text once and copied the cached matcher for every later request: its totals
    # are logged when the last constrained row is dropped, which the next step (this request's) does
    r = requests.post(url + "/generate", json={"inputs": prompt(1), "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while not (totals := shard_grammar_totals(tiny_server.log_path)) or totals["reused"] < 64:
        assert time.monotonic() < deadline, totals
        time.sleep(0.2)
    assert totals["compiled"] < totals["reused"] and totals["steps"] > 0 and totals["apply_s"] > 0


def shard_grammar_totals(log_path) -> dict[str, float]:
    """The last `grammar totals:` line of the shard (services.shard.grammar.matchers) in the server's log."""
    found = re.findall(r"grammar totals: ((?:\w+=[0-9.]+ ?)+)", log_path.read_text(errors="replace"))
    return {k: float(v) for k, v in (f.split("=", 1) for f in found[-1].split())} if found else {}


def test_a_constrained_row_does_not_depend_on_its_batch(tiny_server):
    """Greedy and seeded rows give the same answer alone as in a crowd: the mask touches its own row only."""
    url = tiny_server.url
    cases = [generate_case(i) for i in (1, 3, 4, 5)]

    async def run(crowd: int):
        async with aiohttp.ClientSession() as session:
            noise = [post_generate(session, url, generate_case(7 + 8 * k)[1], False) for k in range(crowd)]
            got = await asyncio.gather(*(post_generate(session, url, c[1], False) for c in cases), *noise)
            return got[: len(cases)]

    assert asyncio.run(run(0)) == asyncio.run(run(12))


def test_streamed_tool_calls_add_up_to_the_answer(tiny_server):
    url = tiny_server.url
    messages = [{"role": "user", "content": "what is the weather in Oslo"}]
    for choice in ("required", "get_weather", {"type": "function", "function": {"name": "noop"}}, "auto"):
        body = {"messages": messages, "tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 80}
        body["tool_prompt"] = TOOL_PROMPT
        whole = requests.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        r = requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        events = sse_events(r.content)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == whole["finish_reason"]
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert all(d["role"] == "assistant" for d in deltas)
        if "tool_calls" not in whole["message"]:  # auto: plain content, whose first visible character is not {
            assert choice == "auto" and not whole["message"]["content"].lstrip().startswith("{")
            assert "".join(d["content"] for d in deltas) == whole["message"]["content"]
            continue
        (call,) = whole["message"]["tool_calls"]
        check_call(call)
        assert all("content" not in d and len(d["tool_calls"]) == 1 for d in deltas)
        pieces = [d["tool_calls"][0] for d in deltas]
        assert pieces[0]["function"]["name"] == call["function"]["name"] and pieces[0]["function"]["arguments"] == "{"
        assert all(p["function"]["name"] is None and p["id"] == call["id"] == "0" for p in pieces[1:])
        assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
        assert "no_tool" not in json.dumps(whole)


# ---- bad input: TGI's 422s, and the server goes on -------------------------------------------------------------
BAD = [
    ({"type": "json", "value": {"type": "nonsense"}}, "validation", P + "grammar is not valid: "),
    ({"type": "json", "value": "{not json"}, "validation", P + "grammar is not valid: "),
    ({"type": "regex", "value": "(unclosed"}, "validation", P + "grammar is not valid: "),
    ("root ::= missing_rule", "validation", P + "grammar is not valid: "),
    ({"type": "json", "value": 7}, "validation", P + "grammar is not supported"),
    ({"type": "json", "value": {"type": "array", "items": json.loads("[" * 70 + "]" * 70)}}, "validation", P),
]


@pytest.mark.parametrize("grammar,error_type,start", BAD)
def test_bad_grammars_are_tgis_422(tiny_server, grammar, error_type, start):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "grammar": grammar}}
    r = requests.post(tiny_server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["error_type"] == error_type and r.json()["error"].startswith(start), r.text


def test_too_deep_and_too_large_schemas(tiny_server):
    deep: dict = {}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    large = {"type": "object", "properties": {f"k{i:06d}" + "x" * 40: {"type": "integer"} for i in range(6000)}}
    for schema, end in ((deep, "levels deep, more than the limit of 64"), (large, "more than the limit of 262144")):
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "grammar": {"type": "json", "value": schema}}}
        r = requests.post(tiny_server.url + "/generate", json=body, timeout=30)
        assert r.status_code == 422 and r.json()["error"].endswith(end), r.text[:300]


def test_tool_errors_are_tgis_422_even_when_streaming(tiny_server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": True}
    for extra, message in (
        ({"tool_choice": "nope"}, "Tool error: Tool with name nope not found"),
        ({"response_format": {"type": "json_object"}}, "Tool error: Grammar and tools are mutually exclusive"),
    ):
        r = requests.post(tiny_server.url + "/v1/chat/completions", json={**chat, **extra}, timeout=30)
        assert r.status_code == 422 and r.json() == {"error": message, "error_type": "tool_error"}
    r = requests.post(tiny_server.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200


# ---- preemption mid-JSON ----------------------------------------------------------------------------------------
LIST = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"k": {"enum": ["alpha", "beta", "gamma"]}, "v": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k", "v"],
    },
    "minItems": 5,
    "maxItems": 5,
}


def test_a_request_preempted_mid_json_ends_as_an_uninterrupted_run(pressed_server):
    url = pressed_server.url
    bodies = [
        {
            "inputs": prompt(i)[:120],
            "parameters": {
                "max_new_tokens": 150,
                "details": True,
                "grammar": {"type": "json", "value": LIST},
                **({"do_sample": True, "seed": 5 + i} if i % 2 else {}),
            },
        }
        for i in range(6)
    ]

    async def run(together: bool):
        async with aiohttp.ClientSession() as session:

            async def ids(body):
                async with session.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
                    return [t["id"] for t in out["details"]["tokens"]], out["generated_text"]

            if together:
                return await asyncio.gather(*(ids(b) for b in bodies))
            return [await ids(b) for b in bodies]

    alone = asyncio.run(run(False))
    before = scheduler_counter(url, "preemptions")
    crowded = asyncio.run(run(True))
    assert counter_rises(url, "preemptions", before)  # some were preempted and recomputed, their matchers replayed
    # greedy rows are exact; a sampled row's draw compares a uniform number with probabilities whose last float bits
    # depend on the batch's composition (alone vs six together), so it may flip at a near tie: it is held to the
    # grammar, not to the alone run's tokens (seeded replay of the same batch is tested in tests/shard)
    assert [c for i, c in enumerate(crowded) if i % 2 == 0] == [a for i, a in enumerate(alone) if i % 2 == 0]
    for _, text in alone + crowded:
        check_json(text, LIST)


# ---- --disable-grammar-support ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disabled_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "grammar-disabled.log"
    with Server(
        tiny_model_dir, log, "--max-total-tokens", "512", "--disable-grammar-support", clean_log=False
    ) as server:
        yield server


def test_disabled_grammar_support_refuses_every_shape(disabled_server):
    url = disabled_server.url
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    for path, body in (
        ("/generate", {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "a+"}}}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required"}),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}),
    ):
        r = requests.post(url + path, json=body, timeout=30)
        assert r.status_code == 422, r.text
        assert r.json() == {"error": P + "grammar is not supported", "error_type": "validation"}
    r = requests.post(url + "/v1/chat/completions", json={**chat, "response_format": {"type": "text"}}, timeout=30)
    assert r.status_code == 200
