"""SIGTERM of `switchyard serve` drains: /health turns 503 and new requests get TGI's 503 at once, the streams
open at that moment end with their normal final event, a stream still running at --graceful-termination-timeout
ends with TGI's error event, and then every process exits and the run directory is gone."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from libs.protocol.messages import Heartbeat, TokenBatch
from libs.runtime import bus
from tests.e2e.server import Server, session_processes
from tests.e2e.test_scale import Tap, generate, prompt
from tests.ports import free_port_range
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e
TIMEOUT_S = 1.5  # the short streams take a fraction of it, the long one (2000 tokens) seconds


class Stream(threading.Thread):
    """One SSE request read to its end; `first` is set once its first event came."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list = []
        self.first = threading.Event()
        self.done = threading.Event()  # its last event came
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
            self.done.set()


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
        params = {"max_new_tokens": 96, "details": True}
        tgi = [
            Stream(server.url + "/generate_stream", {"inputs": f"drain {i}", "parameters": params}) for i in range(3)
        ]
        openai = Stream(
            server.url + "/v1/chat/completions",
            # ignore_eos: a random model's greedy EOS depends on the CPU's float32 kernels (near-ties)
            {
                "model": "tgi",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 96,
                "stream": True,
                "ignore_eos": True,
            },
        )
        long = Stream(server.url + "/generate_stream", {"inputs": "long", "parameters": {"max_new_tokens": 2000}})
        streams = [*tgi, openai, long]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(30) and not s.error, s.error
        # a short stream may end between its first event and the signal on a fast step: count the open ones
        open_at_signal = sum(not s.done.is_set() for s in streams)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)

        assert wait_until(lambda: requests.get(server.url + "/health", timeout=5).status_code == 503, 5)
        assert requests.get(server.url + "/livez", timeout=5).status_code == 200  # liveness: not to be restarted
        refused = requests.post(server.url + "/generate", json={"inputs": "late"}, timeout=5)
        assert refused.status_code == 503
        assert refused.json() == {"error": "the server is shutting down", "error_type": "unavailable"}
        metrics = requests.get(server.url + "/metrics", timeout=5).text
        assert "switchyard_draining 1" in metrics and "switchyard_drain_refused_total 1" in metrics

        for s in streams:
            s.join(TIMEOUT_S + 20)
            assert not s.is_alive() and s.error is None, s.error
        for s in tgi:  # each ended with its normal final event (EOS may come first on some CPUs: near-ties)
            assert s.events[-1]["details"]["finish_reason"] in ("length", "eos_token"), s.events[-1]
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
        assert "draining http and the schedulers" in log
        running = int(re.search(r"draining: (\d+) requests running", log).group(1))
        assert 2 <= running <= open_at_signal, (running, open_at_signal)  # the long one and some short ones
        assert "drain cut short: 1 requests" in log
        assert "Traceback" not in log, server.tail(100)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.log.close()


def test_sigterm_of_a_scheduler_drains_its_replica(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """Two replicas; SIGTERM to the scheduler running a long stream: its heartbeat says `draining` at once, every
    request that comes next is placed on the other replica (each greedy-equal to transformers'), the long stream
    ends normally, and the drained scheduler exits on its own (0, not restarted) without waiting for the timeout."""
    monkeypatch.setattr(bus, "_curve", None)  # the tap's sockets: plaintext on loopback, as the server's
    monkeypatch.setattr(bus, "_plaintext_ok", True)
    spec = f"tcp://127.0.0.1:{free_port_range(5)}?replicas=127.0.0.1:{free_port_range(6)}"
    flags = ("--replicas", "2", "--bus-address", spec, "--bus-insecure", "--graceful-termination-timeout", "60")
    server = Server(tiny_model_dir, tmp_path / "replica-drain.log", *flags)
    tap = None
    try:
        server.wait_healthy()
        tap = Tap(spec, prefixes=(b"hb.", b"tok."))
        body = {"inputs": "long", "parameters": {"max_new_tokens": 2000, "details": True}}
        long = Stream(server.url + "/generate_stream", body)
        long.start()
        assert long.first.wait(30) and not long.error, long.error
        [(long_id, (replica,))] = tap.wait_for(lambda: list(tap.replicas_of().items()))  # the tap's thread may lag
        other = 1 - replica
        sent = time.monotonic()
        os.kill(server.pid("scheduler", replica), signal.SIGTERM)

        def draining() -> bool:
            return any(isinstance(m, Heartbeat) and m.role == "scheduler" and m.index == replica and m.draining
                       for _, m in tap.seen())  # fmt: skip

        tap.wait_for(draining, timeout=5)
        announced = time.monotonic() - sent
        cases = [(prompt(700 + i), 5) for i in range(6)]
        with ThreadPoolExecutor(len(cases)) as pool:  # served first, checked against transformers after
            answers = list(pool.map(lambda case: generate(server.url, *case), cases))
        for (text, n), ids in zip(cases, answers):
            assert ids == reference_generate(tiny_model_dir, tiny_tokenizer(text).input_ids, n), text
        tap.wait_for(lambda: len(tap.replicas_of()) >= 7)  # every answer's rows seen by the tap
        on_replica = {rid for rid, replicas in tap.replicas_of().items() if replica in replicas}
        assert on_replica == {long_id}, "a request was placed on the draining replica"
        assert len(tap.replicas_of()) == 7 and all(r == {other} for r in tap.replicas_of().values() if r != {replica})

        long.join(60)
        assert not long.is_alive() and long.error is None, long.error

        # the new requests ran while the long stream still ran on the draining replica (the tap's order is the bus's)
        def order() -> tuple[int, int] | None:
            rows = [m for _, m in tap.seen() if isinstance(m, TokenBatch)]
            ends = [i for i, b in enumerate(rows) for rid, f in zip(b.request_ids, b.finish) if rid == long_id and f]
            new = [i for i, b in enumerate(rows) if set(b.request_ids) - {long_id}]
            return (new[0], ends[-1]) if ends and new else None

        first_new, long_end = tap.wait_for(order)  # the tap's thread may lag the client
        assert first_new < long_end, "the long stream ended before the new requests came: nothing was shown"
        assert long.events[-1]["details"]["finish_reason"] == "length", long.events[-1]
        assert len([e for e in long.events if e.get("token")]) == 2000

        def exited():
            info = server.rpc("getProcessInfo", f"scheduler:scheduler_{replica}")
            return info if info["statename"] == "EXITED" else None

        info = tap.wait_for(exited, timeout=30)
        assert info["exitstatus"] == 0
        assert time.monotonic() - sent < 30, "the drained scheduler waited for its timeout"
        log = server.log_path.read_text(errors="replace")
        assert f"scheduler.{replica} is up" in log and "draining: nothing new is placed on it" in log
        assert "drained: every request this replica held has ended" in log
        assert announced < 3, announced
        assert requests.get(server.url + "/health", timeout=5).status_code == 200  # the other replica serves
    finally:
        if tap is not None:
            tap.close()
        server.stop()
