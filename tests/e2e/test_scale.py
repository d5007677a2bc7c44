"""Scale-out end to end: 2 tokenizers, 2 detokenizers, 2 http workers on one port and 2 model replicas.

Every request is answered exactly as transformers' generate() would (greedy), the work spreads over
every process (from their own heartbeat counters and the bus's topics, seen through a tap), and no
request's token stream is ever split over two detokenizers. A detokenizer started by hand joins and
takes work; stopped, it loses no request placed after it left. Over tcp (loopback), the router+http
side and the scheduler+shard side run under two separate launchers, as on two hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from transformers import AutoTokenizer

from launcher.tap import TAP_TOPIC, attach
from libs.protocol import ProtocolError, codec
from libs.protocol.messages import Heartbeat, TextBatch, TokenBatch
from libs.runtime import bus
from tests.e2e.server import ROOT, Server
from tests.ports import free_port_range
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

WORDS = "seven wizards quietly hum old songs while the quick brown fox jumps over a lazy dog".split()
SCALE_FLAGS = ("--tokenizer-workers", "2", "--detokenizer-workers", "2", "--http-workers", "2", "--replicas", "2")
LIMITS = ("--max-total-tokens", "512", "--max-input-tokens", "400")


def prompt(i: int) -> str:
    n = 4 + (i * 5) % 40  # 4..43 words: some prompts span several KV blocks
    return " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(n))


class Tap(threading.Thread):
    """Everything on the given topics of a server's event bus, recorded from the moment it is attached."""

    def __init__(self, bus: str, prefixes=(b"tok.", b"out.", b"hb.")):
        super().__init__(daemon=True)
        self.sub, self.pub = attach(bus, list(prefixes), timeout=10)
        self.events: list[tuple[bytes, object]] = []
        self.lock = threading.Lock()
        self.running = True
        self.start()

    def run(self) -> None:
        while self.running:
            if not self.sub.poll(100):
                continue
            frames = self.sub.recv_multipart(copy=False)
            if bytes(frames[0]).startswith(TAP_TOPIC):
                continue
            try:
                topic, msg = codec.decode_pub([f.buffer for f in frames])
            except ProtocolError:
                continue
            with self.lock:
                self.events.append((topic, msg))

    def close(self) -> None:
        self.running = False
        self.join(5)
        self.sub.close()
        self.pub.close()

    def seen(self) -> list[tuple[bytes, object]]:
        with self.lock:
            return list(self.events)

    def detokenizers_of(self) -> dict[str, set[bytes]]:
        """request id → the tok.<k> topics its token rows went to."""
        out = defaultdict(set)
        for topic, msg in self.seen():
            if isinstance(msg, TokenBatch):
                for rid in msg.request_ids:
                    out[rid].add(topic)
        return out

    def replicas_of(self) -> dict[str, set[int]]:
        out = defaultdict(set)
        for _, msg in self.seen():
            if isinstance(msg, TokenBatch):
                for rid in msg.request_ids:
                    out[rid].add(msg.replica)
        return out

    def ingresses_of(self) -> dict[str, set[bytes]]:
        """request id → the out.<ingress> topics its text rows went to (the http process holding it)."""
        out = defaultdict(set)
        for topic, msg in self.seen():
            if isinstance(msg, TextBatch):
                for row in msg.rows:
                    out[row.request_id].add(topic)
        return out

    def counters(self, role: str) -> dict[int, dict[str, int]]:
        """The latest heartbeat counters of every process of a role, by index."""
        latest = {}
        for _, msg in self.seen():
            if isinstance(msg, Heartbeat) and msg.role == role:
                latest[msg.index] = msg.counters
        return latest

    def ready_replicas(self) -> set[int]:
        """The replicas whose scheduler's latest heartbeat says ready (its shard has loaded the model)."""
        latest = {}
        for _, msg in self.seen():
            if isinstance(msg, Heartbeat) and msg.role == "scheduler":
                latest[msg.index] = msg.ready and not msg.draining
        return {i for i, ready in latest.items() if ready}

    def wait_for(self, what, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            time.sleep(0.2)
        raise TimeoutError("the tap never saw what was expected")


def generate(url: str, text: str, max_new: int) -> list[int]:
    body = {"inputs": text, "parameters": {"max_new_tokens": max_new, "details": True}}
    r = requests.post(url + "/generate", json=body, timeout=120)  # a new connection each: SO_REUSEPORT spreads them
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def check_greedy(url: str, model_dir, tokenizer, cases: list[tuple[str, int]]) -> None:
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: generate(url, *c), cases))
    for (text, n), ids in zip(cases, got):
        assert ids == reference_generate(model_dir, tokenizer(text).input_ids, n), text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def scale_server(tiny_model_dir, tmp_path_factory):
    with Server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "scale-server.log", *LIMITS, *SCALE_FLAGS) as server:
        yield server


@pytest.fixture
def tap(scale_server):
    t = Tap(f"ipc://{scale_server.run_dir()}")
    yield t
    t.close()


def test_processes_run_as_groups(scale_server):
    # (a shard counts as STARTING for its first 120 s: startsecs covers loading the model)
    names = sorted(
        p["name"] for p in scale_server.rpc("getAllProcessInfo") if p["statename"] in ("RUNNING", "STARTING")
    )
    assert names == sorted(
        ["router_0", "scheduler_0", "scheduler_1", "shard_0", "shard_1"]
        + ["tokenizer_0", "tokenizer_1", "detokenizer_0", "detokenizer_1", "http_0", "http_1"]
    )
    assert scale_server.pid("tokenizer") != scale_server.pid("tokenizer", 1)
    assert scale_server.env("shard", 1)["SWITCHYARD_INDEX"] == "1"
    # either http worker answers /health and /metrics for the whole server; a worker's view of the others'
    # metrics fills in as their heartbeats carry them (every second or so), so poll until both have it all
    wanted = [("tokenizer", 1), ("detokenizer", 1), ("scheduler", 1), ("http", 0), ("http", 1)]
    complete, deadline, missing = 0, time.monotonic() + 30, wanted
    while complete < 8:
        assert time.monotonic() < deadline, f"/metrics never showed every process: {missing}"
        assert requests.get(scale_server.url + "/health", timeout=5).status_code == 200
        text = requests.get(scale_server.url + "/metrics", timeout=5).text
        up = [line for line in text.splitlines() if line.startswith("switchyard_process_up{")]
        missing = [(r, i) for r, i in wanted if not any(f'role="{r}"' in u and f'index="{i}"' in u for u in up)]
        if missing:
            complete = 0
            time.sleep(0.5)
        else:
            complete += 1


def test_every_request_is_answered_and_the_work_spreads(scale_server, tap, tiny_model_dir, tokenizer):
    before = {role: tap.wait_for(lambda r=role: tap.counters(r)) for role in ("tokenizer", "router")}
    # /health is ready with one replica; on a loaded host the second shard may still be loading its model, and a
    # burst then all goes to the first (placement takes ready replicas only)
    tap.wait_for(lambda: tap.ready_replicas() == {0, 1}, timeout=120)
    cases = [(prompt(i), 4 + (i * 3) % 13) for i in range(16)]
    check_greedy(scale_server.url, tiny_model_dir, tokenizer, cases)

    detoks, replicas, ingresses = tap.detokenizers_of(), tap.replicas_of(), tap.ingresses_of()
    assert len(detoks) == 16 and set(ingresses) == set(detoks)
    # a request's stream never splits: one detokenizer, one replica, one http process each
    assert all(len(t) == 1 for t in detoks.values()), detoks
    assert all(len(r) == 1 for r in replicas.values()), replicas
    assert all(len(i) == 1 for i in ingresses.values()), ingresses
    # and the requests spread over every detokenizer, replica and http worker
    assert {t for ts in detoks.values() for t in ts} == {b"tok.0000", b"tok.0001"}
    assert {r for rs in replicas.values() for r in rs} == {0, 1}
    assert {i for s in ingresses.values() for i in s} == {b"out.0000", b"out.0001"}

    def grew(role: str, key: str) -> dict[int, int]:
        now = tap.counters(role)
        delta = {i: now[i].get(key, 0) - before[role].get(i, {}).get(key, 0) for i in now}
        return delta if len(delta) == 2 and all(delta.values()) else {}

    # the processes' own counters (heartbeats, once a second) say the same, once every heartbeat has come
    tokenized = tap.wait_for(lambda: (d := grew("tokenizer", "handled")) and sum(d.values()) >= 16 and d)
    assert sum(tokenized.values()) == 16

    def placed() -> dict[int, int]:  # the router's heartbeat may come after the tokenizers' (a second apart)
        router = tap.counters("router")[0]
        was = before["router"][0]
        got = {r: router.get(f"placed_replica_{r}", 0) - was.get(f"placed_replica_{r}", 0) for r in (0, 1)}
        return got if sum(got.values()) >= 16 else {}

    by_replica = tap.wait_for(placed)
    assert sum(by_replica.values()) == 16 and all(by_replica.values()), by_replica


def test_a_detokenizer_started_by_hand_takes_work_and_leaves_cleanly(scale_server, tap, tiny_model_dir, tokenizer):
    env = {**scale_server.env("detokenizer", 0), "SWITCHYARD_INDEX": "2"}
    extra = subprocess.Popen([sys.executable, "-m", "services.detokenizer"], cwd=ROOT, env=env)
    try:
        tap.wait_for(lambda: 2 in tap.counters("detokenizer"))
        time.sleep(1.5)  # the router hears the same heartbeat; give it a beat
        cases = [(prompt(100 + i), 6) for i in range(9)]
        check_greedy(scale_server.url, tiny_model_dir, tokenizer, cases)
        used = {t for ts in tap.detokenizers_of().values() for t in ts}
        assert b"tok.0002" in used, used  # it took streams, without a restart
        tap.wait_for(lambda: tap.counters("detokenizer")[2].get("tokens", 0))  # its own counter agrees
    finally:
        extra.send_signal(signal.SIGTERM)
        assert extra.wait(10) is not None
    # once it has left the live view, requests only go to the others, and all succeed. It says goodbye on SIGTERM (a
    # leaving heartbeat): the router, which reads every waiting heartbeat before it places a request, has it too
    tap.wait_for(
        lambda: any(
            isinstance(m, Heartbeat) and m.role == "detokenizer" and m.index == 2 and m.leaving for _, m in tap.seen()
        )
    )
    start = len(tap.seen())
    check_greedy(scale_server.url, tiny_model_dir, tokenizer, [(prompt(200 + i), 5) for i in range(6)])
    late = {topic for topic, msg in tap.seen()[start:] if isinstance(msg, TokenBatch)}
    assert late and b"tok.0002" not in late


def test_two_launchers_over_tcp_loopback(tiny_model_dir, tokenizer, tmp_path):
    bus = f"tcp://127.0.0.1:{free_port_range(5)}?replicas=127.0.0.1:{free_port_range(3)}"
    common = (*LIMITS, "--bus-address", bus, "--bus-insecure")  # plaintext on loopback, on purpose
    front = Server(tiny_model_dir, tmp_path / "front.log", *common, "--only", "router,http,tokenizer,detokenizer")
    back = Server(tiny_model_dir, tmp_path / "back.log", *common, "--only", "scheduler,shard")
    try:
        front.wait_healthy()
        assert back.proc.poll() is None
        running = {p["name"] for p in back.rpc("getAllProcessInfo") if p["statename"] in ("RUNNING", "STARTING")}
        assert running == {"scheduler_0", "shard_0"}
        assert not [p for p in front.rpc("getAllProcessInfo") if p["group"] in ("scheduler", "shard")]
        check_greedy(front.url, tiny_model_dir, tokenizer, [(prompt(300 + i), 6) for i in range(4)])
        assert not [f for f in os.listdir(front.run_dir()) if f.startswith(("intake", "events"))]  # no ipc sockets
    finally:
        front.stop()
        back.stop()


def test_a_second_process_claiming_a_live_identity_is_refused(scale_server, tap, tiny_model_dir, tokenizer):
    """A detokenizer started by hand with the index of a live one (as a second host copying the first's settings
    would) hears the live one's heartbeat on their shared topic, says so and exits with EXIT_CLAIMED; the live
    one goes on serving, its heartbeats unchanged."""

    def runs_of_detokenizer_0() -> list[str]:
        return [
            m.instance for _, m in tap.seen() if isinstance(m, Heartbeat) and m.role == "detokenizer" and not m.index
        ]

    holder = tap.wait_for(runs_of_detokenizer_0)[-1]
    before = scale_server.pid("detokenizer", 0)
    env = {**scale_server.env("detokenizer", 0), "SWITCHYARD_INDEX": "0"}
    second = subprocess.run(
        [sys.executable, "-m", "services.detokenizer"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert second.returncode == bus.EXIT_CLAIMED, second.stdout + second.stderr
    assert "detokenizer 0 is already running" in second.stdout + second.stderr
    start = len(runs_of_detokenizer_0())
    check_greedy(scale_server.url, tiny_model_dir, tokenizer, [(prompt(400 + i), 5) for i in range(3)])
    tap.wait_for(lambda: len(runs_of_detokenizer_0()) > start and runs_of_detokenizer_0()[-1] == holder)
    assert scale_server.pid("detokenizer", 0) == before  # never restarted: the same run holds the index
