"""A request sent right after a kill -9 succeeds although the restarted process has not announced itself yet
(docs/recovery.md, "the restart hold"): the process that needs it, http for a tokenizer, the router for a
detokenizer or a scheduler, holds the request while that role is awaited and sends it on once it is heard.

supervisord restarts a killed process within a second, which usually announces itself before its predecessor's
heartbeats go stale. To make the gap certain, the restarted process is frozen (SIGSTOP) once it is up, as a slow
start on a loaded machine would leave it, until its peers count it as gone; the request is sent then, and the
process runs again once the log shows the request waiting for it. The request must end with the undisturbed
run's tokens, and the waiting process's log must show the wait and its end."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import requests

from tests.e2e.test_health import generate, health, tokens
from tests.e2e.test_restarts import expected_tokens, wait_healthy

pytestmark = pytest.mark.e2e

WAITER = {"tokenizer": "http", "router": "http", "detokenizer": "router", "scheduler": "router"}
WAITED = {"tokenizer": "tokenizer", "router": "tokenizer", "detokenizer": "detokenizer", "scheduler": "scheduler"}
RELEASED = {"http": "a tokenizer is back", "router": "placing 1 held requests"}
# on /metrics only while http's view has a live process of the role (what its heartbeats carry)
SIGN_OF_LIFE = {
    "tokenizer": "switchyard_tokenizer_handled_total",
    "detokenizer": "switchyard_detokenizer_tokens_total",
    "scheduler": "switchyard_replica_queue_size",
}


def new_log(server, mark: int) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def wait_for(condition, what: str, server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}:\n{server.tail(40)}"
        time.sleep(0.05)


def http_hears(url: str, role: str) -> bool:
    """Whether http's view has a live process of `role` (see SIGN_OF_LIFE)."""
    try:
        return SIGN_OF_LIFE[role] in requests.get(url + "/metrics", timeout=2).text
    except requests.RequestException:
        return True


@pytest.mark.parametrize("role", ["tokenizer", "detokenizer", "router", "scheduler"])
def test_a_request_right_after_a_kill_waits_for_the_restart(tiny_server, tiny_model_dir, role):
    url, waiter, waited = tiny_server.url, WAITER[role], WAITED[role]
    text = f"sent while the {role} restarts"
    expected = expected_tokens(tiny_model_dir, text, 6)
    wait_healthy(url, 90)
    mark = tiny_server.log_path.stat().st_size
    old = tiny_server.pid(role)
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: tiny_server.pid(role) not in (0, old), "supervisord did not restart it", tiny_server)
    new = tiny_server.pid(role)
    up = re.compile(rf"^\S+ \w+ router\.\d+ .*{role}\.0 is up \(pid {new}\)", re.M)
    wait_for(lambda: up.search(new_log(tiny_server, mark)), f"the new {role} never announced itself", tiny_server, 90)
    os.kill(new, signal.SIGSTOP)
    out: dict = {}
    try:
        # its peers count it as gone (the router's view is http's: the same heartbeats at the same moments)
        wait_for(lambda: not http_hears(url, waited), f"http still hears a {waited}", tiny_server)
        assert health(url) == 503
        client = threading.Thread(target=generate, args=(url, text, out), daemon=True)
        client.start()
        held = re.compile(rf"^\S+ \w+ {waiter}\.\d+ .*no live {waited}.* yet: the request waits for one", re.M)
        wait_for(lambda: held.search(new_log(tiny_server, mark)), f"the {waiter} did not hold the request", tiny_server)
        assert "status" not in out, out  # held: not failed
    finally:
        os.kill(new, signal.SIGCONT)
    client.join(60)
    assert out.get("status") == 200, out
    assert tokens(out) == expected
    released = re.compile(rf"^\S+ \w+ {waiter}\.\d+ .*{RELEASED[waiter]}", re.M)
    assert released.search(new_log(tiny_server, mark)), tiny_server.tail(40)
    wait_healthy(url, 90)
