"""Several hosts on one machine (network namespaces joined by veth pairs, made by the test; tests/faults/netns.py):
the router, http, tokenizer and detokenizer on a front host, each model replica (scheduler and shard, a tcp bus) on
a host of its own, every one a `switchyard serve` as on separate machines. Under load, every stream ends with the
tokens of an undisturbed run (transformers' generate()), while:

- a replica started later on another host is placed on, with nothing in the front host's configuration naming it;
- the router is killed (-9) and restarted by supervisord: nothing running is lost;
- a replica's host is killed outright (SIGKILL of its launcher, supervisord, scheduler and shard): its streams are
  resubmitted by http once it is gone and finish on the other replica;
- a replica's launcher gets SIGTERM: its scheduler drains (the router places nothing new on it, new requests are
  answered by the other), and the host is gone within the graceful termination timeout and the launcher's margin.

The test's client threads enter the front host's namespace and talk to its loopback; nothing else is addressed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.e2e.server import ROOT, Server, session_processes
from tests.e2e.test_restarts import expected_tokens
from tests.faults.netns import Hosts

pytestmark = pytest.mark.e2e

BUS_PORT, REPLICA_PORT, HTTP_PORT = 5550, 5560, 3000
LIMITS = ("--max-total-tokens", "2048", "--max-input-tokens", "400", "--bus-insecure")
DRAIN_S = 3.0  # the replicas' --graceful-termination-timeout
DRAIN_MARGIN_S = 5.0  # the launcher's wait beyond it (launcher/supervise.py), before it stops the rest
LONG = 300  # tokens per stream: long enough to be mid-stream when a host goes
PROMPTS = [f"host {i}: the {i} brown foxes of the far valley" for i in range(4)]


class Host(Server):
    """One `switchyard serve` inside host i's namespace (the e2e Server's log, run directory and supervisord)."""

    def __init__(self, hosts: Hosts, i: int, model_dir, log_path: Path, *flags: str):
        self.url = f"http://127.0.0.1:{HTTP_PORT}"  # inside host i: only the front host serves it
        self.log_path = log_path
        argv = [sys.executable, "-m", "launcher", "serve", "--model-id", str(model_dir), "--dtype", "float32"]
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(
            hosts.command(i, [*argv, *LIMITS, *flags]), cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_logged(self, text: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.tail()}")
            assert time.monotonic() < deadline, f"never logged {text!r}:\n{self.tail()}"
            time.sleep(0.1)

    def kill_outright(self) -> None:
        """The host dies: SIGKILL to the launcher and every process of its supervisord's session at once."""
        run_dir, sid = self.run_dir(), self.supervisord_sid()
        pids = [self.proc.pid, *(session_processes(sid) if sid is not None else [])]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.log.close()
        subprocess.run(["rm", "-rf", run_dir], check=False)  # a dead server's directory (the next serve would)


class Client:
    """HTTP from threads inside the front host's namespace, to its loopback."""

    def __init__(self, hosts: Hosts, url: str, threads: int = 32):
        self.url = url
        self.pool = ThreadPoolExecutor(threads, initializer=hosts.enter, initargs=(0,))

    def call(self, fn, *args):
        return self.pool.submit(fn, *args).result()

    def health(self) -> int:
        def get():
            try:
                return requests.get(self.url + "/health", timeout=5).status_code
            except requests.RequestException:
                return 0

        return self.call(get)

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != 200:
            assert time.monotonic() < deadline, "the front host never became healthy"
            time.sleep(0.2)

    def generate(self, texts: list[str], n: int) -> list[list[int]]:
        """Each text's greedy answer (token ids), sent at once."""

        def post(text: str) -> list[int]:
            body = {"inputs": text, "parameters": {"max_new_tokens": n, "details": True}}
            r = requests.post(self.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        return list(self.pool.map(post, texts))

    def streams(self, texts: list[str], n: int) -> list[dict]:
        """Start one stream per text; each dict gets its token ids, its error event if any, and `done`."""
        outs = [{"tokens": [], "error": None, "done": False} for _ in texts]
        for text, out in zip(texts, outs):
            out["future"] = self.pool.submit(self._stream, text, n, out)
        return outs

    def _stream(self, text: str, n: int, out: dict) -> None:
        body = {"inputs": text, "parameters": {"max_new_tokens": n}}
        try:
            with requests.post(self.url + "/generate_stream", json=body, stream=True, timeout=(5, 90)) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data:"):
                        event = json.loads(line[5:])
                        if "error" in event:
                            out["error"] = event
                            return
                        out["tokens"].append(event["token"]["id"])
                        out["done"] = event.get("generated_text") is not None
        except requests.RequestException as e:
            out["error"] = {"error": repr(e)}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Tap:
    """`switchyard tap` on the front host's bus (heartbeats, as JSON lines): the router's placements per replica
    and each scheduler's state."""

    def __init__(self, hosts: Hosts, path: Path):
        self.path = path
        self.out = open(path, "w")
        bus = f"tcp://{hosts.address(0)}:{BUS_PORT}"
        argv = [sys.executable, "-m", "launcher.tap", "--bus", bus, "--topic", "hb.", "--json"]
        env = {**os.environ, "SWITCHYARD_BUS_INSECURE": "1"}
        self.proc = subprocess.Popen(
            hosts.command(0, argv), cwd=ROOT, stdout=self.out, stderr=subprocess.DEVNULL, env=env
        )

    def beats(self) -> list[dict]:
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return out

    def placed(self) -> dict[str, int]:
        routers = [b for b in self.beats() if b["role"] == "router"]
        return routers[-1]["counters"] if routers else {}

    def scheduler_ready(self, index: int, not_pid: int = 0) -> bool:
        return any(b["role"] == "scheduler" and b["index"] == index and b["ready"] and b["pid"] != not_pid
                   for b in self.beats())  # fmt: skip

    def scheduler_idle(self, index: int) -> bool:
        """Replica `index`'s latest beat holds no request: the router's view of its load is current."""
        beats = [b for b in self.beats() if b["role"] == "scheduler" and b["index"] == index]
        return bool(beats) and beats[-1]["queue"] == 0 and beats[-1]["running"] == 0

    def scheduler_pid(self, index: int) -> int:
        return [b["pid"] for b in self.beats() if b["role"] == "scheduler" and b["index"] == index][-1]

    def wait(self, condition, timeout: float = 60.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while not (got := condition()):
            assert time.monotonic() < deadline, f"the tap never saw {what}"
            time.sleep(0.2)
        return got

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.out.close()


@pytest.fixture
def hosts():
    why = Hosts.unavailable()
    if why is not None:
        pytest.skip(f"several hosts need network namespaces: {why}")
    made = Hosts(3)
    try:
        yield made.make()
    finally:
        made.close()
        assert not made.left(), "network namespaces left behind"


def replica_flags(hosts: Hosts, i: int, replica: int) -> tuple[str, ...]:
    """A replica host's flags: its scheduler binds host i's own address, it reaches the router on the front host."""
    spec = f"tcp://{hosts.address(0)}:{BUS_PORT}?replicas={hosts.address(i)}:{REPLICA_PORT}"
    return ("--only", "scheduler,shard", "--bus-address", spec, "--replica-base", str(replica),
            "--graceful-termination-timeout", str(DRAIN_S))  # fmt: skip


def check(outs: list[dict], texts: list[str], expected: dict[str, list[int]], what: str) -> None:
    for out in outs:
        out["future"].result(timeout=120)
    for text, out in zip(texts, outs):
        assert out["error"] is None and out["done"], f"{what}: {out['error']}"
        assert out["tokens"] == expected[text], f"{what}: a stream's tokens differ from generate()'s"


def test_replicas_on_other_hosts_join_die_drain_and_survive_a_router_restart(hosts, tiny_model_dir, tmp_path):
    expected = {text: expected_tokens(tiny_model_dir, text, LONG) for text in PROMPTS}
    short = {f"short {i} of the far valley": None for i in range(6)}
    for text in short:
        short[text] = expected_tokens(tiny_model_dir, text, 5)
    texts = PROMPTS * 2  # 8 streams at a time
    front_spec = f"tcp://{hosts.address(0)}:{BUS_PORT}?replicas={hosts.address(1)}:{REPLICA_PORT}"
    front = Host(hosts, 0, tiny_model_dir, tmp_path / "front.log", "--only", "router,http,tokenizer,detokenizer",
                 "--bus-address", front_spec, "--hostname", "127.0.0.1", "--port", str(HTTP_PORT))  # fmt: skip
    first = Host(hosts, 1, tiny_model_dir, tmp_path / "replica-0.log", *replica_flags(hosts, 1, 0))
    later = tap = client = None
    try:
        client = Client(hosts, front.url)
        client.wait_healthy()
        tap = Tap(hosts, tmp_path / "tap.jsonl")

        # a replica started later on another host is placed on
        later = Host(hosts, 2, tiny_model_dir, tmp_path / "replica-1.log", *replica_flags(hosts, 2, 1))
        tap.wait(lambda: tap.scheduler_ready(1), 240, "replica 1 ready")
        assert client.generate(list(short), 5) == list(short.values())
        tap.wait(lambda: tap.placed().get("placed_replica_1", 0) > 0, 10, "a request placed on replica 1")
        assert f"replica 1 joins at tcp://{hosts.address(2)}:{REPLICA_PORT + 3}" in front.log_path.read_text()

        # the router killed -9 mid-stream: supervisord restarts it, nothing running is lost
        outs = client.streams(texts, LONG)
        tap.wait(lambda: all(o["tokens"] for o in outs), 60, "every stream started")
        os.kill(front.pid("router"), signal.SIGKILL)
        check(outs, texts, expected, "router restart")

        # replica 1's host dies outright mid-stream: http resubmits its streams once it is gone; replica 0 ends them
        # the router places by the load it last heard: both replicas' beats say they hold nothing (each says so
        # at once when its last request ends), so the new streams spread over both
        tap.wait(lambda: tap.scheduler_idle(0) and tap.scheduler_idle(1), 10, "both replicas idle")
        before = tap.placed()
        pid_1 = tap.scheduler_pid(1)
        outs = client.streams(texts, LONG)
        tap.wait(lambda: all(o["tokens"] for o in outs), 60, "every stream started")
        later.kill_outright()
        assert not all(o["done"] for o in outs), "the streams ended before the host died: nothing shown"
        tap.wait(lambda: tap.placed().get("placed_replica_1", 0) > before.get("placed_replica_1", 0), 10,
                 "a stream placed on replica 1")  # fmt: skip
        check(outs, texts, expected, "replica host killed")
        assert "is gone: resubmitting" in front.log_path.read_text(errors="replace")

        # it comes back (a new host process for replica 1), and replica 0's launcher gets SIGTERM under load
        later = Host(hosts, 2, tiny_model_dir, tmp_path / "replica-1b.log", *replica_flags(hosts, 2, 1))
        tap.wait(lambda: tap.scheduler_ready(1, not_pid=pid_1), 240, "replica 1 back")
        outs = client.streams(texts, LONG)
        tap.wait(lambda: all(o["tokens"] for o in outs), 60, "every stream started")
        sent = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)
        front.wait_logged("draining: nothing new is placed on it", 10)
        assert client.generate(list(short), 5) == list(short.values())  # answered by replica 1 meanwhile
        check(outs, texts, expected, "replica drained")
        first.proc.wait(DRAIN_S + DRAIN_MARGIN_S + 10)
        ended = time.monotonic() - sent
        assert ended < DRAIN_S + DRAIN_MARGIN_S + 5, f"the drained host took {ended:.1f} s to stop"
        log_0 = first.log_path.read_text(errors="replace")
        assert "SIGTERM: draining" in log_0
        assert "drained: every request this replica held has ended" in log_0 or "handing them back" in log_0
        first.log.close()
        print(f"\nreplica host SIGTERM under load: stopped after {ended:.1f} s (timeout {DRAIN_S:g} s)")
    finally:
        if client is not None:
            client.close()
        if tap is not None:
            tap.close()
        for host in (later, first, front):
            if host is not None and host.proc.poll() is None:
                host.stop(clean_log=False)
