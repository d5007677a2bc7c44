"""A server lives as long as its launcher: kill -9 of the launcher stops every process of it and frees its
port; a run directory left by a server that died never passes for a live one, and the next server removes it.

The servers here keep their run directories under a root of their own ($SWITCHYARD_RUN_ROOT), so the other
servers on this machine (other tests, other users of /tmp) neither disturb the tap's choice nor get swept.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher import rundir
from tests.e2e.server import ROOT, Server, session_processes
from tests.e2e.test_tap import Tap, generate

pytestmark = pytest.mark.e2e


@pytest.fixture
def run_root():
    root = tempfile.mkdtemp(prefix="sy-life-", dir="/tmp")  # short: ipc socket paths are limited
    yield {rundir.ROOT_VAR: root}
    shutil.rmtree(root, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def server_pids(server: Server) -> list[int]:
    """supervisord and its programs (they share supervisord's session)."""
    sid = server.supervisord_sid()
    assert sid is not None
    pids = session_processes(sid)
    assert len(pids) >= 7, pids  # supervisord and six programs
    return pids


def launch(model_dir, log: Path, env: dict, port: int | None = None) -> Server:
    server = Server(model_dir, log, *(["--port", str(port)] if port else []), env=env)
    if port:  # the later --port wins over the one Server picked
        server.port, server.url = port, f"http://127.0.0.1:{port}"
    return server


def healthy(*servers: Server) -> None:
    """Wait for every server (launched together: their starts overlap); on failure none is left running."""
    try:
        for server in servers:
            server.wait_healthy()
    except BaseException:
        for server in servers:
            server.proc.kill()
        raise


def start(model_dir, log: Path, env: dict, port: int | None = None) -> Server:
    server = launch(model_dir, log, env, port)
    healthy(server)
    return server


def tap_without_bus(env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher.tap", "--timeout", "5"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **env})


def kill_whole_server(server: Server) -> tuple[str, list[int]]:
    """kill -9 every process of a server at once, as the OOM killer or a CI timeout does: nothing cleans up."""
    run_dir, pids = server.run_dir(), server_pids(server)
    supervisord = int((Path(run_dir) / "supervisord.pid").read_text())
    os.kill(supervisord, signal.SIGSTOP)  # frozen: it neither restarts programs nor stops them cleanly
    server.proc.send_signal(signal.SIGKILL)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait()
    server.log.close()
    assert wait_until(lambda: not any(map(alive, pids)), 30)
    return run_dir, pids


def test_dead_servers_free_their_port_and_the_tap_finds_the_live_one(tiny_model_dir, tmp_path, run_root):
    """One story over three servers (a server start costs seconds, so the two kinds of death share the live one).
    A's launcher is killed: all of A stops, its port frees, its run directory stays, provably
    dead, until the next server (C, on A's port) removes it. B dies whole, frozen supervisord and all, leaving its
    sockets: the tap, with no --bus, still attaches to the one live server, C."""
    a, b = launch(tiny_model_dir, tmp_path / "a.log", run_root), launch(tiny_model_dir, tmp_path / "b.log", run_root)
    healthy(a, b)
    c = None
    try:
        # it says where it serves and how to stop it, once it is up
        ready = f"ready: {tiny_model_dir} at {a.url} (Ctrl-C to stop)"
        assert wait_until(lambda: ready in a.log_path.read_text(), 30), a.tail()
        both = tap_without_bus(run_root)  # two live servers: the tap cannot choose
        assert both.returncode != 0 and "pick one with --bus" in both.stderr, both.stderr
        assert f"ipc://{a.run_dir()}" in both.stderr and f"ipc://{b.run_dir()}" in both.stderr

        # kill -9 of A's launcher alone: its server stops with it (the parent-death signal)
        a_dir, a_pids = a.run_dir(), server_pids(a)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        a.log.close()
        assert wait_until(lambda: not any(map(alive, a_pids)), 30), [p for p in a_pids if alive(p)]
        # the run directory stays behind (no one was left to remove it), but provably dead
        assert os.path.isdir(a_dir) and rundir.state(Path(a_dir)) == rundir.DEAD

        c = start(tiny_model_dir, tmp_path / "c.log", run_root, port=a.port)  # the port is free
        assert not os.path.exists(a_dir)  # removed as stale by the next server
        assert f"removed the run directory {a_dir} of a server that is no longer running" in c.tail(200)
        assert c.run_dir() != a_dir

        b_dir, _ = kill_whole_server(b)
        b = None
        assert (Path(b_dir) / "events-out").exists()  # its sockets are left, as after any crash

        tap = Tap(env=run_root)  # no --bus
        try:
            assert f"ipc://{c.run_dir()}" in tap.attached
            answer = generate(c.url, "the quick brown fox", 6)
            seen = tap.until_final(1)
        finally:
            tap.stop()
        tokens = [r["token_id"] for r in seen if r["event"] == "token"]
        assert tokens == [t["id"] for t in answer["details"]["tokens"]]
    finally:
        if a.proc.poll() is None:
            a.proc.kill()
        if b is not None:
            kill_whole_server(b)
        if c is not None:
            c.stop()
