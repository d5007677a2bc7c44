"""Clients that go away: a stream closed mid-generation frees its KV blocks at once, a request whose client left
before it was placed never generates (and one held on its way to the scheduler, its tokenizer frozen, is dropped
on arrival without a prefill), and after many random disconnects nothing is left behind (no running or queued
request, every KV block free). The scheduler's own counters and gauges (its heartbeat, via /metrics) and the
processes' log lines (request_id=…) are the evidence. The 1,000-disconnect soak is in tests/faults."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time

import pytest
import requests

from tests.e2e.conftest import fresh_metrics

pytestmark = pytest.mark.e2e

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def scheduler_state(text: str) -> dict[str, int]:
    """The scheduler's gauges and counters in a /metrics text; the load gauges are switchyard_<name>{replica} or
    switchyard_replica_<name>{replica}, depending on the /metrics version."""
    state = {m[0]: int(m[1]) for m in re.findall(r'^switchyard_(?:replica_)?(\w+)\{replica="0"\} (\d+)$', text, re.M)}
    for name, value in re.findall(r'^switchyard_scheduler_(\w+)_total\{index="0"\} (\d+)$', text, re.M):
        state[name] = int(value)
    return state


def settled(url: str, timeout: float = 30.0) -> dict[str, int]:
    """The scheduler's state, rendered after this call began, once nothing is running or queued."""
    deadline = time.monotonic() + timeout
    while True:
        state = scheduler_state(fresh_metrics(url, ("scheduler",), timeout))
        if state["batch_current_size"] == 0 and state["queue_size"] == 0:
            return state
        assert time.monotonic() < deadline, f"the scheduler did not settle: {state}"


def assert_no_ghosts(state: dict[str, int]) -> None:
    assert state["batch_current_size"] == 0 and state["queue_size"] == 0, state
    assert state["kv_blocks_free"] == state["kv_blocks_total"] > 0, state


def long_prompt(url: str, tokens: int = 300) -> str:
    """A prompt the tiny model continues for `tokens` tokens without hitting EOS."""
    for i in range(60):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5 + i % 13))
        body = {"inputs": text, "parameters": {"max_new_tokens": tokens, "details": True}}
        out = requests.post(url + "/generate", json=body, timeout=120).json()
        if out["details"]["finish_reason"] == "length":
            return text
    raise AssertionError("no prompt runs to the length limit")


def _http_request(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data


async def disconnect_once(port: int, kind: str, text: str, rng: random.Random, max_new_tokens: int = 300) -> str:
    """One client that leaves early, in one of several ways; returns the kind."""
    path = "/generate_stream" if kind in ("stream", "immediate_stream") else "/generate"
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "stream": True}
        body["max_tokens"] = max_new_tokens
    else:
        body = {"inputs": text, "parameters": {"max_new_tokens": max_new_tokens}}
    raw = _http_request(port, path, body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if kind == "partial_body":  # headers and half the body, then gone
            writer.write(raw[: len(raw) - rng.randint(1, len(json.dumps(body)) // 2)])
            await writer.drain()
            return kind
        writer.write(raw)
        await writer.drain()
        if kind.startswith("immediate"):
            return kind
        if kind == "blocking":  # a non-streamed /generate abandoned after a while
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            return kind
        events = rng.randint(1, 5)  # stream, chat: leave after a few events
        while events:
            line = await asyncio.wait_for(reader.readline(), 60)
            if not line:
                break
            events -= line.startswith(b"data:")
        return kind
    finally:
        writer.transport.abort()  # a RST-free close without waiting for the server


KINDS = ["stream", "chat", "immediate", "immediate_stream", "blocking", "partial_body"]


async def random_disconnects(port: int, text: str, n: int, concurrency: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    done: dict[str, int] = {}

    async def one(i: int):
        async with sem:
            kind = await disconnect_once(port, rng.choice(KINDS), text, rng)
            done[kind] = done.get(kind, 0) + 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return done


def test_stream_closed_mid_generation_frees_its_blocks(tiny_server):
    url = tiny_server.url
    text = long_prompt(url)
    before = settled(url)
    assert_no_ghosts(before)
    port = tiny_server.port

    async def scenario():
        # several streams at once, each closed after a few events: their blocks must all come back
        await asyncio.gather(*(disconnect_once(port, "stream", text, random.Random(i)) for i in range(8)))

    asyncio.run(scenario())
    after = settled(url)
    assert_no_ghosts(after)
    generated = after["generated"] - before["generated"]
    assert generated < 8 * 300 // 4, f"aborted streams ran on: {generated} tokens"


def test_abort_before_placement_never_runs_to_the_end(tiny_server):
    """Clients that close right after sending: the http process aborts as soon as the router places the
    request, so none of them generates more than a handful of tokens (not the 300 asked for)."""
    url = tiny_server.url
    text = long_prompt(url)
    before = settled(url)
    mark = tiny_server.log_path.stat().st_size
    n = 20

    async def scenario():
        await asyncio.gather(
            *(disconnect_once(tiny_server.port, "immediate", text, random.Random(i)) for i in range(n))
        )

    asyncio.run(scenario())
    after = settled(url)
    assert_no_ghosts(after)
    # none ran to its end: a cancel that landed with the request's Accepted was once swallowed (ingress.next_event)
    finished = logged_ids(new_log(tiny_server, mark), "http", "Success:")
    assert not finished, finished
    generated = after["generated"] - before["generated"]
    assert generated < n * 300 // 10, f"requests whose client left ran on: {generated} tokens"


def new_log(server, mark: int) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def logged_ids(text: str, role: str, words: str) -> set[str]:
    """The request ids of `role`'s log lines that contain `words` (text logs end with request_id=<id>)."""
    return set(re.findall(rf"^\S+ \w+ {role}\.\d+ .*{words}.* request_id=(\w+)$", text, re.M))


def wait_logged(server, mark: int, role: str, words: str, n: int, timeout: float = 30.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while len(ids := logged_ids(new_log(server, mark), role, words)) < n:
        assert time.monotonic() < deadline, f"{len(ids)} of {n} {role} lines with {words!r}:\n{server.tail(30)}"
        time.sleep(0.2)
    return ids


HELD = 10


def test_abort_before_placement_never_prefills(tiny_server):
    """Requests held on their way to the scheduler (the tokenizer is frozen by SIGSTOP, so they wait on its
    socket) whose clients then leave: http's Abort reaches the scheduler first, and when the tokenizer runs
    again and the requests arrive, the scheduler drops them (they never prefill or generate). A control
    request held the same way but kept open is served: held requests really do flow on afterwards."""
    url, port = tiny_server.url, tiny_server.port
    text = long_prompt(url, 50)
    control_body = {"inputs": "hello there", "parameters": {"max_new_tokens": 5, "details": True}}
    before = settled(url)
    mark = tiny_server.log_path.stat().st_size
    tokenizer = tiny_server.pid("tokenizer")

    async def open_request(path: str, body: dict):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_http_request(port, path, body))
        await writer.drain()
        return reader, writer

    async def scenario():
        # frozen, not stopped: a stopped one says goodbye and http refuses requests at once, while a frozen
        # one counts as alive for STALE_AFTER (3 s) after its last heartbeat, and we send at once
        os.kill(tokenizer, signal.SIGSTOP)
        body = {"inputs": text, "parameters": {"max_new_tokens": 50}}
        leaving = [await open_request("/generate", body) for _ in range(HELD)]
        control_reader, control_writer = await open_request("/generate", control_body)
        # every one was pushed onto the bus: each went unanswered long enough for http to submit it again
        await asyncio.to_thread(wait_logged, tiny_server, mark, "http", "resubmitting", HELD + 1)
        for reader, writer in leaving:
            assert not reader.at_eof(), "http answered a held request"
            writer.transport.abort()
        aborted = await asyncio.to_thread(wait_logged, tiny_server, mark, "http", "client went away", HELD)
        # http published their Abort as it logged that; the scheduler is up and hears it at once, and the
        # requests cannot overtake it while the tokenizer is frozen
        await asyncio.sleep(0.5)
        os.kill(tokenizer, signal.SIGCONT)
        raw = await asyncio.wait_for(control_reader.read(), 60)
        control_writer.close()
        return aborted, raw

    try:
        aborted, raw = asyncio.run(scenario())
    finally:
        os.kill(tokenizer, signal.SIGCONT)
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:300]
    control_tokens = json.loads(payload)["details"]["generated_tokens"]
    # each aborted request did reach the scheduler, after its Abort, and was dropped there
    deadline = time.monotonic() + 30
    while missing := aborted - logged_ids(new_log(tiny_server, mark), "scheduler", "dropped"):
        assert time.monotonic() < deadline, f"{len(missing)} aborted requests never reached the scheduler"
        time.sleep(0.2)
    after = settled(url)
    assert_no_ghosts(after)
    assert after["prefill_rows"] - before["prefill_rows"] == 1, (before, after)  # the control's alone
    assert after["generated"] - before["generated"] == control_tokens, (before, after)


def test_fifty_random_disconnects_leave_no_ghost(tiny_server):
    url = tiny_server.url
    text = long_prompt(url)
    asyncio.run(random_disconnects(tiny_server.port, text, n=50, concurrency=10, seed=7))
    assert_no_ghosts(settled(url))
    ok = requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200, ok.text
