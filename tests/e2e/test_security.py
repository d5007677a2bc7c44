"""Security properties: nothing on the bus can run code (no pickle, marshal or eval in services/, libs/,
launcher/); the run directory is private (0700) and gone after stop; the bus listens on no TCP port by default
(the only listening socket is the HTTP port, on the address asked for); the API key is compared in constant
time; client-chosen headers never reach a log line unescaped; HF_TOKEN, the API key and the bus's CURVE secret
never appear in any process's log output or command line (tests/e2e/test_bus_curve.py checks the secret again on
a server whose tcp bus is encrypted with it)."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest
import requests

from libs.runtime.bus import curve_keypair
from tests.e2e.server import ROOT, Server, session_processes

SOURCES = [p for d in ("services", "libs", "launcher") for p in sorted((ROOT / d).rglob("*.py"))]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "jsonpickle"}
UNSAFE_CALLS = {"eval", "exec", "__import__", "compile"}
API_KEY = "sk-Sw1tchyardSecurityKey-4242"
HF_TOKEN = "hf_SecretTokenThatMustNeverBeLogged9876"
CURVE_PUBLIC, CURVE_SECRET = curve_keypair()


# --------------------------------------------------------------------------------------------
# static checks (no server)


def _unsafe(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                found.append(f"{f.id}()")
            elif isinstance(f, ast.Attribute) and f.attr == "load" and ast.unparse(f.value) in ("torch", "yaml"):
                kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if kwargs.get("weights_only") != "True" and kwargs.get("Loader") != "yaml.SafeLoader":
                    found.append(f"{ast.unparse(f)}() without a safe loader")
            elif isinstance(f, ast.Attribute) and f.attr in ("eval", "exec") and ast.unparse(f.value) == "builtins":
                found.append(ast.unparse(f))
            for k in node.keywords:
                if k.arg == "allow_pickle" and ast.unparse(k.value) != "False":
                    found.append("allow_pickle")
    return found


def test_the_guard_catches_what_it_looks_for():
    bad = "import pickle\nfrom marshal import loads\neval('1')\ntorch.load(f)\nnp.load(f, allow_pickle=True)\n"
    assert len(_unsafe(ast.parse(bad))) == 5
    assert _unsafe(ast.parse("torch.load(f, weights_only=True)\nre.compile('x')\nmodel.eval()\n")) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_marshal_or_eval(path):
    assert _unsafe(ast.parse(path.read_text(), str(path))) == [], path


def test_api_key_is_compared_in_constant_time():
    """The check must go through hmac.compare_digest, never `==` on the key."""
    tree = ast.parse((ROOT / "services/http/middleware.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "api_key")
    calls = {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    assert "hmac.compare_digest" in calls, calls
    equalities = [
        ast.unparse(n)
        for n in ast.walk(fn)
        if isinstance(n, ast.Compare) and any(isinstance(op, ast.Eq | ast.NotEq) for op in n.ops)
    ]
    assert not [c for c in equalities if "expected" in c or "given" in c], equalities


# --------------------------------------------------------------------------------------------
# a server with secrets set


@pytest.fixture(scope="module")
def secret_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "secret-server.log"
    env = {"HF_TOKEN": HF_TOKEN, "HUGGING_FACE_HUB_TOKEN": HF_TOKEN, "LOG_LEVEL": "debug"}
    env["SWITCHYARD_CURVE_SECRET_KEY"] = CURVE_SECRET  # read by the launcher, handed to every service
    with Server(
        tiny_model_dir, log, "--max-total-tokens", "512", "--api-key", API_KEY, env=env, clean_log=False
    ) as server:
        yield server


def _listening_tcp() -> dict[int, str]:
    """socket inode → 'ip:port' of every listening TCP socket on the host."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                addr, port = fields[1].rsplit(":", 1)
                out[int(fields[9])] = f"{addr}:{int(port, 16)}"
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def test_run_directory_is_private(secret_server):
    run_dir = Path(secret_server.run_dir())
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert run_dir.stat().st_uid == os.getuid()
    names = {p.name for p in run_dir.iterdir()}
    assert {"intake", "admit", "events-in", "events-out", "supervisor.sock"} <= names, names
    # Server.stop (the fixture's teardown) asserts that the directory is gone afterwards


def test_the_bus_listens_on_no_tcp_port(secret_server):
    """Default bus is ipc in the private run directory: the only TCP listener is HTTP, on 127.0.0.1 as asked."""
    listening = _listening_tcp()
    sid = secret_server.supervisord_sid()
    pids = session_processes(sid) + [secret_server.proc.pid]
    ours = {listening[i] for pid in pids for i in _socket_inodes(pid) if i in listening}
    loopback = f"0100007F:{secret_server.port}"  # 127.0.0.1 in /proc/net/tcp's little-endian hex
    assert ours == {loopback}, ours
    log = Path(secret_server.log_path).read_text(errors="replace")
    assert "ipc://" in log or "run directory" in log


def test_secrets_never_logged_and_client_headers_escaped(secret_server):
    url = secret_server.url
    auth = {"Authorization": f"Bearer {API_KEY}"}
    hostile = {"X-Request-Id": "../../etc/passwd", "traceparent": "00-INJECTED-../../x-01", "User-Agent": "../x"}
    # control characters cannot even arrive in a header: aiohttp's parser refuses them (400) and goes on
    r = requests.post(
        url + "/generate", json={"inputs": "x"}, headers={**auth, "traceparent": "00-\x1b[2J"}, timeout=60
    )
    assert r.status_code == 400
    # but a body can carry anything: a prompt and a stop sequence that try to start log lines of their own
    forged = "hello\n2026-01-01T00:00:00.000 ERROR INJECTED\x1b[2J\r\u2028INJECTED"
    body = {"inputs": forged, "parameters": {"max_new_tokens": 3, "stop": [forged]}}
    for headers in (auth, {"Authorization": "Bearer wrong-" + API_KEY}, {}, {**auth, **hostile}):
        requests.post(url + "/generate", json=body, headers=headers, timeout=60)
    bad = {"inputs": forged, "parameters": {"top_p": 5.0}}
    r = requests.post(url + "/generate", json=bad, headers={**auth, **hostile}, timeout=60)
    assert r.status_code == 422
    r = requests.post(url + "/generate", json=body, headers={**auth, **hostile}, timeout=60)
    assert r.status_code == 200, r.text
    assert "../" not in "".join(r.headers.values())  # no client id echoed back into headers
    requests.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": API_KEY}]}, timeout=60)
    requests.get(url + "/metrics", timeout=10)
    # every process's output (supervisord forwards it to the launcher's) and supervisord's own log
    logs = Path(secret_server.log_path).read_text(errors="replace")
    logs += (Path(secret_server.run_dir()) / "supervisord.log").read_text(errors="replace")
    for secret in (API_KEY, HF_TOKEN, API_KEY.lower(), CURVE_SECRET):
        assert secret not in logs, f"a secret reached the logs: {secret[:6]}…"
    assert "\x1b" not in logs, "a client's control characters reached a log line unescaped"
    for line in logs.splitlines():
        assert "INJECTED" not in line.split(" ", 3)[:3], line  # never where a timestamp or level goes
    # the children's command lines carry no secret either (the environment is private to the user)
    for pid in session_processes(secret_server.supervisord_sid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert API_KEY not in cmdline and HF_TOKEN not in cmdline and CURVE_SECRET not in cmdline, pid
    # and the services did get the secret (so the checks above had something to find)
    assert secret_server.env("router").get("SWITCHYARD_CURVE_SECRET_KEY") == CURVE_SECRET


def test_request_ids_are_server_made():
    """The ids on the bus are the server's own hex; nothing the client sends becomes one (checked in code:
    every request id is uuid4().hex or secrets.token_hex)."""
    made = []
    for path in ("services/http/tgi/routes.py", "services/http/openai/routes.py", "services/http/generation.py"):
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "request_id":
                made.append(ast.unparse(node.value))
    assert made and all("uuid.uuid4().hex" in m or "token_hex" in m or m in ("rid", "request_id") for m in made), made
