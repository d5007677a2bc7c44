"""The tap: rows of each event kind, run-dir discovery, and a real attach/print/detach on a proxy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from launcher import rundir, tap
from libs.protocol import Addresses, codec, topics
from libs.protocol.messages import (
    FINISH_EOS,
    FINISH_NONE,
    Abort,
    FinalInfo,
    Heartbeat,
    TextBatch,
    TextRow,
    TokenBatch,
)

ROOT = Path(__file__).resolve().parents[2]


def token_batch() -> TokenBatch:
    return TokenBatch(
        replica=0,
        request_ids=["a" * 32, "b" * 32],
        offsets=np.array([0, 4], "<u4"),
        token_ids=np.array([11, 12], "<i4"),
        logprobs=np.array([-0.5, np.nan], "<f4"),
        finish=np.array([FINISH_NONE, FINISH_EOS], "u1"),
        top_counts=np.array([], "<i4"),
        top_ids=np.array([], "<i4"),
        top_logprobs=np.array([], "<f4"),
    )


def text_batch() -> TextBatch:
    final = FinalInfo(generated_text="hi\n", finish_reason="length", generated_tokens=2, input_length=3)
    return TextBatch(
        rows=[
            TextRow(request_id="a" * 32, index=1, token_id=11, text="hi", logprob=-0.5, special=False),
            TextRow(request_id="a" * 32, index=2, token_id=12, text="\n", logprob=-0.1, special=False, final=final),
        ]
    )


def test_token_rows():
    rows = tap.rows(b"tok.0000", token_batch())
    assert rows[0] == {
        "topic": "tok.0000",
        "event": "token",
        "request_id": "a" * 32,
        "offset": 0,
        "token_id": 11,
        "logprob": -0.5,
        "finish": None,
    }
    assert rows[1]["finish"] == "eos_token" and rows[1]["logprob"] is None
    assert [r["token_id"] for r in tap.rows(b"tok.0000", token_batch(), request="b" * 32)] == [12]
    assert tap.render(rows[1]) == f"tok.0000 {'b' * 32} offset=4 token=12 logprob=None finish=eos_token"


def test_text_rows():
    rows = tap.rows(b"out.0001", text_batch())
    assert [r["index"] for r in rows] == [1, 2]
    assert rows[1]["final"] == {"finish_reason": "length", "generated_tokens": 2, "generated_text": "hi\n"}
    line = tap.render(rows[1])
    assert "\n" not in line and 'text="\\n"' in line and "final=length tokens=2" in line
    assert tap.rows(b"out.0001", text_batch(), request="c" * 32) == []


def test_other_rows():
    (row,) = tap.rows(b"ctl.0000", Abort(request_id="a" * 32))
    assert row == {"topic": "ctl.0000", "event": "Abort", "request_id": "a" * 32}
    (hb,) = tap.rows(b"hb.scheduler.0000", Heartbeat(role="scheduler", index=0, pid=7, queue=2, metrics="x 1"))
    assert hb["event"] == "hb" and hb["queue"] == 2 and "metrics" not in hb
    assert tap.rows(b"hb.scheduler.0000", Heartbeat(role="scheduler", index=0, pid=7), request="a" * 32) == []


def test_find_bus_attaches_only_to_a_live_server():
    where = Path(tempfile.mkdtemp(prefix="sy-tap-", dir="/tmp"))
    held = []
    try:
        with pytest.raises(SystemExit, match="no running Switchyard"):
            tap.find_bus(where)
        (where / "switchyard-e2e.lock").write_text("")  # not a run directory
        (where / "switchyard-other").mkdir()  # no lock: not a server we know to be running
        dead, fd = rundir.create(where)
        (dead / "events-out").write_text("")  # a server that died: its sockets stay, its lock is free
        os.close(fd)
        with pytest.raises(SystemExit, match="no running Switchyard"):
            tap.find_bus(where)
        one, fd = rundir.create(where)
        held.append(fd)
        (one / "events-out").write_text("")
        assert tap.find_bus(where) == f"ipc://{one}"
        two, fd = rundir.create(where)
        held.append(fd)
        (two / "events-out").write_text("")
        with pytest.raises(SystemExit, match="several") as e:
            tap.find_bus(where)
        assert f"ipc://{one}" in str(e.value) and f"ipc://{two}" in str(e.value) and str(dead) not in str(e.value)
    finally:
        for fd in held:
            os.close(fd)
        shutil.rmtree(where)


@pytest.fixture
def proxy(tmp_path):
    """The router's event proxy (XSUB/XPUB) on an ipc run dir, and a PUB into it. The proxy is told to stop and
    joined before its sockets close: a socket closed under another thread's zmq.proxy can abort the process."""
    ctx = zmq.Context.instance()
    addresses = Addresses.parse(f"ipc://{tmp_path}")
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    xsub.bind(addresses.events_in)
    xpub.bind(addresses.events_out)
    control, steer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    control.bind(f"inproc://tap-test-proxy-{id(control)}")
    steer.connect(f"inproc://tap-test-proxy-{id(control)}")
    thread = threading.Thread(target=zmq.proxy_steerable, args=(xsub, xpub, None, control), daemon=True)
    thread.start()
    pub = ctx.socket(zmq.PUB)
    pub.connect(addresses.events_in)
    yield f"ipc://{tmp_path}", pub
    steer.send(b"TERMINATE")
    thread.join(10)
    assert not thread.is_alive(), "the proxy did not stop"
    for sock in (pub, steer, control, xsub, xpub):
        sock.close(0)


def _sigint_ignored_and_blocked() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize("parent", ["plain", "sigint-ignored"])
def test_attach_print_detach(proxy, parent):
    """Also when started with SIGINT ignored and blocked (both survive exec; a long test session's taps once
    never detached): the tap installs its own handler."""
    bus, pub = proxy
    cmd = [sys.executable, "-m", "launcher.tap", "--bus", bus, "--json"]
    pre = _sigint_ignored_and_blocked if parent == "sigint-ignored" else None
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pre)
    try:
        assert "# attached to" in proc.stderr.readline()  # the subscription is confirmed from here on
        pub.send_multipart(codec.encode_pub(topics.tok(0), token_batch()))
        pub.send_multipart(codec.encode_pub(topics.hb("router", 0), Heartbeat(role="router", index=0, pid=1)))
        pub.send_multipart(codec.encode_pub(topics.out(0), text_batch()))
        got = [json.loads(proc.stdout.readline()) for _ in range(4)]
        assert [(r["event"], r.get("offset", r.get("index"))) for r in got] == [
            ("token", 0),
            ("token", 4),
            ("text", 1),
            ("text", 2),
        ]  # heartbeats are not on the default topics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_no_server_is_an_error(tmp_path):
    cmd = [sys.executable, "-m", "launcher.tap", "--bus", f"ipc://{tmp_path}", "--timeout", "0.5"]
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30, env={**os.environ})
    assert res.returncode == 1 and "no answer from the event bus" in res.stderr
    assert time.monotonic() - start < 20
