"""Resyncs on a real server (docs/recovery.md): none under a heavy concurrent load that has every feature which
used to look like a lost row (clients leaving mid-stream, stop sequences, speculative multi-token rows,
preemption by a small KV cache); and streams that end whole when a detokenizer really lost rows (kill -9 while
they run).
switchyard_resyncs_total{by,reason} is the evidence; the scheduler's counters show that the features fired."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import aiohttp
import pytest
import requests

from tests.e2e.conftest import fresh_metrics
from tests.e2e.server import Server
from tests.tiny_models import build_model

pytestmark = pytest.mark.e2e

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
REQUESTS, CONCURRENT = 72, 36


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # tiny Gemma-2: its output falls into loops that prompt lookup predicts (~86 % of one-token lookups right, against
    # ~3 % for tiny Qwen2), so rows carry several tokens. The policy drafts every match: the adaptive rule prices
    # drafts by measured step times, and one slow stretch of this VM turned drafting off for a whole run
    model = build_model(tmp_path_factory.mktemp("models") / "tiny-gemma2", "gemma2")
    log = tmp_path_factory.mktemp("logs") / "resync-server.log"
    # 48 KV blocks of 16 tokens for 36 streams, a third of them ~200 tokens long: running streams are preempted
    flags = ("--max-total-tokens", "512", "--max-batch-total-tokens", "768", "--speculate", "2")
    flags += ("--speculate-policy", "always")
    with Server(model, log, *flags) as srv:
        yield srv


def counters(text: str) -> dict[str, float]:
    """The resync counters by reason, and the scheduler's counters that show the features fired, in a /metrics text."""
    out = {
        f"resyncs_{r}": float(v)
        for r, v in re.findall(r'^switchyard_resyncs_total\{.*reason="(\w+)".*\} (\S+)$', text, re.M)
    }
    m = re.search(r'^switchyard_scheduler_preemptions_total\{index="0"\} (\S+)$', text, re.M)
    out["preemptions"] = float(m.group(1)) if m else 0.0
    m = re.search(r"^switchyard_speculative_accepted_tokens_total (\S+)$", text, re.M)
    out["accepted"] = float(m.group(1)) if m else 0.0
    return out


async def one(session: aiohttp.ClientSession, url: str, i: int) -> str:
    """Request i: plain, with stop sequences, or a client that leaves after a few tokens; returns how it ended."""
    text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 29))
    params: dict = {"max_new_tokens": (12, 40, 160)[i // 3 % 3], "details": True}
    kind = ("plain", "stop", "leave")[i % 3 if i % 5 else 2]
    if kind == "stop":
        params["stop"] = [WORDS[i % len(WORDS)], " " + WORDS[(i + 3) % len(WORDS)], "e"]
    events = 0
    async with session.post(url + "/generate_stream", json={"inputs": text, "parameters": params}) as r:
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            events += 1
            if kind == "leave" and events >= 2 + i % 7:
                return "left"  # closing the response mid-stream: http aborts the request
            if event.get("details"):
                return event["details"]["finish_reason"]
    return "no end"


async def load(url: str) -> list[str]:
    sem = asyncio.Semaphore(CONCURRENT)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def bounded(i):
            async with sem:
                return await one(session, url, i)

        return await asyncio.gather(*(bounded(i) for i in range(REQUESTS)))


def settled(url: str) -> dict[str, float]:
    """The counters as every process rendered them after the load ended (every process's last rows counted)."""
    return counters(fresh_metrics(url, timeout=60))


def test_no_resync_under_load_and_whole_streams_when_a_detokenizer_loses_rows(server):
    ends = asyncio.run(load(server.url))
    assert "no end" not in ends
    seen = settled(server.url)
    left = ends.count("left")
    assert left >= REQUESTS // 3 and ends.count("stop_sequence") > 0, ends
    assert seen["preemptions"] > 0 and seen["accepted"] > 0, seen  # the small KV and multi-token rows did act
    # no detokenizer saw a gap (http's watchdog may still ask, on a busy machine, for a row in flight: "replayed")
    assert not seen.get("resyncs_gap") and not seen.get("resyncs_unopened"), seen
    assert "stream gap" not in server.log_path.read_text(errors="replace")

    # kill -9 the detokenizer while streams run: the rows sent to it meanwhile are lost, and the new one, hearing
    # of requests it never opened, asks for them (each stream still ends, its text whole)
    out: list[dict] = [{} for _ in range(2)]

    def stream(i: int) -> None:
        body = {
            "inputs": f"stream {i + 1} goes on while the detokenizer restarts",
            # ~2 s alone on the tiny model: killed once both have a token, most of their rows go to the dead process
            "parameters": {"max_new_tokens": 320, "details": True},
        }
        with requests.post(server.url + "/generate_stream", json=body, stream=True, timeout=(5, 120)) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    event = json.loads(line[5:])
                    out[i]["tokens"] = out[i].get("tokens", 0) + 1
                    out[i]["last"] = event
        out[i]["ended"] = True

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(out))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while sum(o.get("tokens", 0) > 0 for o in out) < len(out):
        assert time.monotonic() < deadline and not any("ended" in o for o in out), out
        time.sleep(0.02)
    old = server.pid("detokenizer")
    os.kill(old, signal.SIGKILL)
    for th in threads:
        th.join(120)
    assert all(o.get("ended") for o in out), "a stream hung"
    for o in out:
        assert "error" not in o["last"] and o["last"]["details"]["generated_tokens"] == o["tokens"], o["last"]
    assert server.pid("detokenizer") not in (0, old)
    # the streams ended whole: the recovery worked. Which side asked (the new detokenizer, "unopened", or http's
    # watchdog) depends on timing, and in one full CI run neither counter showed in /metrics after the restart (to
    # be explained); the reasons a detokenizer asks are tested in tests/services/detokenizer/test_resync.py
