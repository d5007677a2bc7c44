"""Run directories: a held lock tells a live server, a free one (or a socket nobody accepts on) a dead one;
only the provably dead are removed. The parent-death signal stops a child when its parent is killed -9."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher import rundir, supervise

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def where():
    path = Path(tempfile.mkdtemp(prefix="sy-rundir-", dir="/tmp"))  # short: unix socket paths are limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_a_new_run_directory_is_private_and_live_while_its_lock_is_held(where):
    d, fd = rundir.create(where)
    assert d.parent == where and d.name.startswith(rundir.PREFIX)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert sorted(p.name for p in d.iterdir()) == ["lock"]  # locked before it got its name
    assert rundir.state(d) == rundir.LIVE and rundir.live(where) == [d]
    os.close(fd)
    assert rundir.state(d) == rundir.DEAD and rundir.live(where) == []


def test_the_lock_lives_as_long_as_any_process_that_inherited_it(where):
    d, fd = rundir.create(where)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(fd,))
    try:
        os.close(fd)  # the launcher is gone; supervisord (here: the child) still holds the lock
        assert rundir.state(d) == rundir.LIVE
        assert rundir.remove_stale(where) == [] and d.exists()
        child.kill()
        child.wait()
        assert rundir.state(d) == rundir.DEAD
    finally:
        child.kill()
        child.wait()


def test_remove_stale_removes_only_provably_dead_directories(where):
    live, live_fd = rundir.create(where)
    dead, dead_fd = rundir.create(where)
    os.close(dead_fd)
    # a directory of a server without a lock file, whose supervisord socket nobody accepts on any more
    old = where / "switchyard-old"
    old.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(old / "supervisor.sock"))
    # the same, still listening: alive as far as we can tell
    serving = where / "switchyard-serving"
    serving.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(serving / "supervisor.sock"))
    listener.listen()
    # something else with the prefix (a model folder, a directory being made): not provably a dead server
    other = where / "switchyard-bench-llama"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (where / "switchyard-e2e.lock").write_text("")  # a file, not a directory
    (where / "switchyard-link").symlink_to(dead.name)  # never followed
    try:
        states = rundir.scan(where)
        assert states == {
            dead: rundir.DEAD,
            other: rundir.UNKNOWN,
            old: rundir.DEAD,
            serving: rundir.UNKNOWN,
            live: rundir.LIVE,
        }
        assert sorted(rundir.remove_stale(where)) == sorted([dead, old])
        assert not dead.exists() and not old.exists()
        assert live.exists() and serving.exists() and other.exists() and (where / "switchyard-e2e.lock").exists()
        assert rundir.live(where) == [live]
    finally:
        listener.close()
        os.close(live_fd)


def test_root_follows_the_environment(monkeypatch, where):
    monkeypatch.setenv(rundir.ROOT_VAR, str(where))
    assert rundir.root() == where
    d, fd = rundir.create()
    os.close(fd)
    assert d.parent == where
    monkeypatch.delenv(rundir.ROOT_VAR)
    assert rundir.root() == Path("/tmp")


# a parent that starts a child with the launcher's preexec_fn, says the child's pid, and waits to be killed
PARENT = """
import subprocess, sys, time
from launcher import supervise
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         preexec_fn=supervise.die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_started_by_the_launcher_dies_with_it_even_by_sigkill():
    assert supervise.die_with_parent() is not None
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child) and os.getsid(child) == child  # its own session: a group signal would miss it
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until(lambda: not alive(child)), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        if "child" in locals() and alive(child):
            os.kill(child, signal.SIGKILL)


def test_elsewhere_there_is_no_parent_death_signal(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert supervise.die_with_parent() is None  # and supervise.run warns at start


def test_programs_that_cannot_load_are_read_from_the_run_directory(tmp_path):
    assert supervise.cannot_load(tmp_path) == []  # no file: nobody said so
    (tmp_path / "cannot-load").write_text("shard\nshard\n")  # two shards of one server, each appended its role
    assert supervise.cannot_load(tmp_path) == ["shard"]
