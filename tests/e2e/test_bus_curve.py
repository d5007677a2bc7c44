"""The whole bus on tcp with CURVE and client authentication: one real server whose --bus-address names no host
(so it binds loopback), whose secret comes from BUS_CURVE_SECRET_KEY (the flag's own variable) and whose binders
let in only the clients listed in --bus-curve-allowed-keys. Every process joins the encrypted bus (the server
becomes healthy and serves greedy /generate exactly as transformers' generate()), every bus port listens on
127.0.0.1 only, a plaintext subscriber on the event proxy hears nothing while `switchyard tap` with the public
key and a listed client key sees the client's tokens; a tap without the key, or with an unlisted client key,
cannot attach; a request pushed with an unlisted key is never placed (one with a listed key is), a subscriber
with one hears nothing, the refusal is logged once by the key's fingerprint; the secret reaches no log or command
line."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import requests
import zmq
from tokenizers import Tokenizer

from libs.protocol.messages import GenerateRequest
from libs.protocol.params import Parameters
from libs.runtime import bus, bus_auth
from tests.e2e.server import ROOT, Server, session_processes
from tests.ports import free_port_range
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

PUBLIC, SECRET = bus.curve_keypair()
LISTED_PUBLIC, LISTED_SECRET = bus.curve_keypair()  # a client key in the allowed list
STRANGER_PUBLIC, STRANGER_SECRET = bus.curve_keypair()  # one that is not


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
    allowed = tmp_path_factory.mktemp("keys") / "allowed-keys"
    allowed.write_text(f"# the tap\n{LISTED_PUBLIC}\n")
    flags = ("--max-total-tokens", "512", "--bus-address", f"tcp://:{router}?replicas=:{replica}")
    flags += ("--bus-curve-allowed-keys", str(allowed))
    with Server(tiny_model_dir, log, *flags, env={"BUS_CURVE_SECRET_KEY": SECRET}) as server:
        server.bus_ports = (router, replica)
        yield server


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
    stranger_env = {"SWITCHYARD_CURVE_PUBLIC_KEY": PUBLIC, "SWITCHYARD_CURVE_CLIENT_SECRET_KEY": STRANGER_SECRET}
    stranger = _tap(events_bus, "--timeout", "2", env=stranger_env)
    tap = _tap(events_bus, env={"SWITCHYARD_CURVE_PUBLIC_KEY": PUBLIC, "CURVE_CLIENT_KEY": LISTED_SECRET})
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
        assert stranger.wait(timeout=30) != 0
        assert "--curve-client-key" in stranger.stderr.read()
        _requests_and_subscribers_need_a_listed_key(router, rows)
    finally:
        eavesdropper.close()
        for proc in (tap, keyless, stranger):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert tap.returncode == 0
    assert requests.get(curve_server.url + "/health", timeout=5).status_code == 200


def _client(kind: int, address: str, client_secret: str) -> zmq.Socket:
    curve = bus.Curve(server_public=PUBLIC, client_secret=client_secret)
    return bus.socket(kind, connect=address, ctx=zmq.Context.instance(), curve=curve)


def _requests_and_subscribers_need_a_listed_key(router: int, rows: queue.Queue) -> None:
    """A stranger's request is never placed and its subscriber hears nothing; a listed client's request runs."""
    intake, events_out = f"tcp://127.0.0.1:{router}", f"tcp://127.0.0.1:{router + 4}"
    listener = _client(zmq.SUB, events_out, STRANGER_SECRET)
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    sockets = [listener]
    try:
        ids = {}
        for who, secret in (("stranger", STRANGER_SECRET), ("listed", LISTED_SECRET)):
            push = _client(zmq.PUSH, intake, secret)
            sockets.append(push)
            ids[who] = uuid.uuid4().hex
            params = Parameters(max_new_tokens=4)
            bus.send(push, GenerateRequest(request_id=ids[who], ingress=0, inputs=f"from the {who}", parameters=params))
        # the tap (subscribed to every out./tok. topic) sees the listed request to its end, and nothing of the other
        heard = []
        while not any(r["request_id"] == ids["listed"] and "final" in r for r in heard):
            heard.append(rows.get(timeout=30))
        assert ids["stranger"] not in {r["request_id"] for r in heard}
        assert not listener.poll(500), "a subscriber with an unlisted key heard the bus"
    finally:
        for sock in sockets:
            sock.close()


def test_a_refused_client_is_logged_once_by_fingerprint(curve_server):
    logs = Path(curve_server.log_path).read_text(errors="replace")
    fingerprint = bus_auth.fingerprint(STRANGER_PUBLIC)
    refusals = [line for line in logs.splitlines() if "refused a bus client" in line]
    assert refusals and all(fingerprint in line for line in refusals)
    assert len({line.split("]")[0] for line in refusals}) == len(refusals)  # once per process
    for key in (STRANGER_PUBLIC, STRANGER_SECRET, LISTED_SECRET):
        assert key not in logs


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
