"""The whole bus on tcp with CURVE: one real server whose --bus-address names no host (so it binds loopback)
and whose secret comes from SWITCHYARD_CURVE_SECRET_KEY. Every process joins the encrypted bus (the server
becomes healthy and serves greedy /generate exactly as transformers' generate()), every bus port listens on
127.0.0.1 only, a plaintext subscriber on the event proxy hears nothing while `switchyard tap` with the public
key sees the client's tokens, a tap without the key cannot attach, and the secret reaches no log or command
line."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import zmq
from tokenizers import Tokenizer

from libs.runtime import bus
from tests.e2e.server import ROOT, Server, free_port_range, session_processes
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

PUBLIC, SECRET = bus.curve_keypair()


def _listeners(ports: set[int]) -> set[str]:
    """'hexip:port' of the listening tcp sockets on these ports (/proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port, 16) in ports:
                found.add(f"{addr}:{int(port, 16)}")
    return found


@pytest.fixture(scope="module")
def curve_server(tiny_model_dir, tmp_path_factory):
    router, replica = free_port_range(5), free_port_range(3)
    log = tmp_path_factory.mktemp("logs") / "curve-server.log"
    flags = ("--max-total-tokens", "512", "--bus-address", f"tcp://:{router}?replicas=:{replica}")
    server = Server(tiny_model_dir, log, *flags, env={"SWITCHYARD_CURVE_SECRET_KEY": SECRET})
    server.bus_ports = (router, replica)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _tap(events_bus: str, *args: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.tap", "--json", "--bus", events_bus, *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_CURVE_")}
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**clean, **env}
    )


def test_encrypted_bus_serves_and_only_the_key_holder_listens(curve_server, tiny_model_dir):
    router, replica = curve_server.bus_ports
    ports = {*range(router, router + 5), *range(replica, replica + 3)}
    assert _listeners(ports) == {f"0100007F:{p}" for p in ports}  # all bound, all on 127.0.0.1 only
    log_text = Path(curve_server.log_path).read_text(errors="replace")
    assert "encrypted with CURVE" in log_text and PUBLIC in log_text

    # a plaintext subscriber to every topic of the event proxy
    ctx = zmq.Context.instance()
    eavesdropper = ctx.socket(zmq.SUB)
    eavesdropper.setsockopt(zmq.LINGER, 0)
    eavesdropper.setsockopt(zmq.SUBSCRIBE, b"")
    eavesdropper.connect(f"tcp://127.0.0.1:{router + 4}")
    # the tap with the public key only (as a host that merely connects would have it), and one without a key
    events_bus = f"tcp://:{router}"  # host-less: the tap too takes it as loopback
    keyless = _tap(events_bus, "--timeout", "2", env={})
    tap = _tap(events_bus, env={"SWITCHYARD_CURVE_PUBLIC_KEY": PUBLIC})
    rows: queue.Queue = queue.Queue()
    try:
        attached = tap.stderr.readline()
        assert "# attached to tcp://127.0.0.1:" in attached, attached + tap.stderr.read()
        threading.Thread(target=lambda: [rows.put(json.loads(line)) for line in tap.stdout], daemon=True).start()

        text = "the encrypted bus carries"
        body = {"inputs": text, "parameters": {"max_new_tokens": 8, "details": True}}
        r = requests.post(curve_server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        client_ids = [t["id"] for t in r.json()["details"]["tokens"]]
        prompt_ids = Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json")).encode(text).ids
        assert client_ids == reference_generate(tiny_model_dir, prompt_ids, 8)

        seen = []
        while not seen or seen[-1]["event"] != "text" or "final" not in seen[-1]:
            seen.append(rows.get(timeout=30))
        assert [row["token_id"] for row in seen if row["event"] == "token"] == client_ids
        assert "".join(row["text"] for row in seen if row["event"] == "text") == r.json()["generated_text"]
        assert not eavesdropper.poll(1000), "a plaintext subscriber heard the encrypted bus"

        assert keyless.wait(timeout=30) != 0
        assert "--curve-public-key" in keyless.stderr.read()
    finally:
        eavesdropper.close()
        for proc in (tap, keyless):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert tap.returncode == 0
    assert requests.get(curve_server.url + "/health", timeout=5).status_code == 200


def test_the_curve_secret_is_never_logged(curve_server):
    logs = Path(curve_server.log_path).read_text(errors="replace")
    logs += (Path(curve_server.run_dir()) / "supervisord.log").read_text(errors="replace")
    assert SECRET not in logs
    for pid in session_processes(curve_server.supervisord_sid()) + [curve_server.proc.pid]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert SECRET not in cmdline, pid
    # it reaches the services through their environment, private to this user (0400)
    env_file = Path(f"/proc/{curve_server.pid('router')}/environ")
    assert env_file.stat().st_uid == os.getuid() and env_file.stat().st_mode & 0o077 == 0
