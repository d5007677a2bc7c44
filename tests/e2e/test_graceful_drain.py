"""SIGTERM of `switchyard serve` drains: /health turns 503 and new requests get TGI's 503 at once, the streams
open at that moment end with their normal final event, a stream still running at --graceful-termination-timeout
ends with TGI's error event, and then every process exits and the run directory is gone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from tests.e2e.server import Server, session_processes

pytestmark = pytest.mark.e2e
TIMEOUT_S = 1.5  # the short streams take a fraction of it, the long one (2000 tokens) seconds


class Stream(threading.Thread):
    """One SSE request read to its end; `first` is set once its first event came."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list = []
        self.first = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with requests.post(self.url, json=self.body, stream=True, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip().decode()
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first.set()
        except Exception as e:  # a cut connection: the test reports it
            self.error = e
        finally:
            self.first.set()


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_sigterm_drains_open_streams_and_leaves_nothing(tiny_model_dir, tmp_path):
    server = Server(tiny_model_dir, tmp_path / "drain.log", "--graceful-termination-timeout", str(TIMEOUT_S))
    try:
        server.wait_healthy()
        run_dir, sid = server.run_dir(), server.supervisord_sid()
        params = {"max_new_tokens": 48, "details": True}
        tgi = [
            Stream(server.url + "/generate_stream", {"inputs": f"drain {i}", "parameters": params}) for i in range(3)
        ]
        openai = Stream(
            server.url + "/v1/chat/completions",
            {"model": "tgi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48, "stream": True},
        )
        long = Stream(server.url + "/generate_stream", {"inputs": "long", "parameters": {"max_new_tokens": 2000}})
        streams = [*tgi, openai, long]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(30) and not s.error, s.error
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)

        assert wait_until(lambda: requests.get(server.url + "/health", timeout=5).status_code == 503, 5)
        refused = requests.post(server.url + "/generate", json={"inputs": "late"}, timeout=5)
        assert refused.status_code == 503
        assert refused.json() == {"error": "the server is shutting down", "error_type": "unavailable"}
        metrics = requests.get(server.url + "/metrics", timeout=5).text
        assert "switchyard_draining 1" in metrics and "switchyard_drain_refused_total 1" in metrics

        for s in streams:
            s.join(TIMEOUT_S + 20)
            assert not s.is_alive() and s.error is None, s.error
        for s in tgi:  # each ended with its normal final event
            assert s.events[-1]["details"]["finish_reason"] == "length", s.events[-1]
            assert s.events[-1]["generated_text"] is not None
        assert openai.events[-1] == "[DONE]"
        assert openai.events[-2]["choices"][0]["finish_reason"] == "length"
        # the long stream outlived the timeout: TGI's error event, not a cut connection
        assert long.events[-1]["error_type"] == "unavailable"
        assert "shutting down" in long.events[-1]["error"]

        server.proc.wait(TIMEOUT_S + 20)
        assert time.monotonic() - sent < TIMEOUT_S + 15
        assert wait_until(lambda: not session_processes(sid), 10), "processes left behind"
        assert not os.path.exists(run_dir), "run directory left behind"
        log = server.log_path.read_text(errors="replace")
        assert "draining http" in log and "draining: 5 requests running" in log  # all were open at SIGTERM
        assert "drain cut short: 1 requests" in log
        assert "Traceback" not in log, server.tail(100)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.log.close()
