"""/health is 503 while a needed process is missing and 200 again once it is back: heartbeats, not hope.
(docs/recovery.md tells the protocol.)

A kill -9 is repaired by supervisord before a heartbeat goes stale, so here each role is stopped through
supervisord (`supervisorctl stop`) and stays missing: /health must turn 503 within the staleness bound
(libs.runtime.liveness.STALE_AFTER, plus a heartbeat period and the poll), stay 503 as long as the process is
away, and return to 200 once it is started again, after which a greedy /generate equals transformers' generate().

A /generate sent during the outage, as /generate behaves today, per role:
- tokenizer, router: answered with 503 `unavailable` by http (it sees no live tokenizer: with the router gone
  no heartbeat reaches http at all; the request is sent once every heartbeat has gone stale: in the first
  STALE_AFTER seconds of a router outage a request still waits in http's intake socket and completes when the
  router is back). At once, or, while the tokenizer was lost less than RESTART_WAIT_S ago (the router's
  case: its heartbeats go stale a lifetime after the router's own goodbye), once that wait has run out
  (docs/recovery.md; tests/e2e/test_restart_gap.py shows the wait end well);
- detokenizer: answered at once with 503 `unavailable` by the router ("No detokenizer is available");
- scheduler, shard: the request waits (http resubmits or resyncs it) and completes, with the
  undisturbed run's tokens, after the process is started again.
One server for all roles, stopped and started in turn."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from libs.runtime.liveness import RESTART_WAIT_S, STALE_AFTER
from tests.e2e.test_restarts import expected_tokens, wait_healthy

pytestmark = pytest.mark.e2e

# how a /generate sent while the role is missing ends (see the module docstring)
FAILS_FAST = {"tokenizer", "detokenizer", "router"}
WAITS = {"scheduler", "shard"}
ROLES = ["tokenizer", "detokenizer", "router", "scheduler", "shard"]
NEW_TOKENS = 6
HEARTBEAT_S = 1.0
UNHEALTHY_WITHIN = STALE_AFTER + HEARTBEAT_S + 1.0  # last heartbeat just before the stop, stale after, poll slack
OUTAGE_S = 2.0  # how long the process stays away after /health said so


def health(url: str) -> int:
    try:
        return requests.get(url + "/health", timeout=2).status_code
    except requests.RequestException:
        return 0


def generate(url: str, text: str, out: dict) -> None:
    body = {"inputs": text, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    try:
        r = requests.post(url + "/generate", json=body, timeout=120)
        out["status"], out["body"] = r.status_code, r.json()
    except (requests.RequestException, ValueError) as e:
        out["status"], out["body"] = 0, repr(e)
    out["ended"] = time.monotonic()


def tokens(out: dict) -> list[int] | None:
    if out.get("status") != 200:
        return None
    return [t["id"] for t in out["body"]["details"]["tokens"]]


@pytest.mark.parametrize("role", ROLES)
def test_health_follows_a_missing_process(tiny_server, tiny_model_dir, role):
    url = tiny_server.url
    name = f"{role}:{role}_0"
    text = f"the {role} came back"
    expected = expected_tokens(tiny_model_dir, text, NEW_TOKENS)
    wait_healthy(url, 90)
    try:
        assert tiny_server.rpc("stopProcess", name, True)  # waits until supervisord has stopped it
        stopped = time.monotonic()
        while health(url) != 503:
            assert time.monotonic() - stopped < UNHEALTHY_WITHIN, f"/health still not 503 without the {role}"
            time.sleep(0.1)
        unhealthy_after = time.monotonic() - stopped

        settle_end = time.monotonic() + STALE_AFTER + HEARTBEAT_S
        while time.monotonic() < settle_end:  # the outage's steady state: every heartbeat it stops is stale
            assert health(url) == 503, f"/health said 200 while the {role} was stopped"
            time.sleep(0.25)
        during: dict = {}
        client = threading.Thread(target=generate, args=(url, text, during), daemon=True)
        sent = time.monotonic()
        client.start()
        outage_end = time.monotonic() + OUTAGE_S
        while time.monotonic() < outage_end:  # 503 all along: nobody brought it back behind our back
            assert health(url) == 503, f"/health said 200 while the {role} was stopped"
            assert tiny_server.pid(role) == 0
            time.sleep(0.25)
        if role in FAILS_FAST:
            client.join(RESTART_WAIT_S)
            assert "status" in during, f"a /generate without the {role} neither failed nor completed"
            took = during["ended"] - sent
            assert took < RESTART_WAIT_S + 1.0, f"the error took {took:.1f}s"
            assert during["status"] == 503, during
            assert during["body"]["error_type"] == "unavailable" and during["body"]["error"], during
        else:
            assert "status" not in during, f"a /generate without the {role} ended: {during}"
    finally:
        # no wait: supervisord would hold the call for the program's startsecs (the shard's is 120 s)
        tiny_server.rpc("startProcess", name, False)
    restarted = time.monotonic()
    deadline = restarted + 90
    while health(url) != 200:
        assert time.monotonic() < deadline, f"/health not 200 after the {role} was started again"
        time.sleep(0.1)
    healthy_after = time.monotonic() - restarted
    if role in WAITS:
        client.join(60)
        assert tokens(during) == expected, f"the request sent without the {role}: {during}"
    after: dict = {}
    generate(url, text, after)
    assert tokens(after) == expected, after
    print(f"\n{role:12s} 503 after {unhealthy_after:.1f}s stopped, 200 again {healthy_after:.1f}s after its start")


SHARD_STALL_S = 6.0  # --shard-stall-timeout of the tiny_server fixture


def test_health_503_while_the_shard_hangs(tiny_server, tiny_model_dir):
    """A shard that hangs without exiting (SIGSTOP: no disconnect, no restart) shows once a step has been out
    for --shard-stall-timeout; when it runs again, /health is 200 and the waiting request completes exactly."""
    url = tiny_server.url
    text = "the shard froze for a while"
    expected = expected_tokens(tiny_model_dir, text, NEW_TOKENS)
    wait_healthy(url, 90)
    pid = tiny_server.pid("shard")
    during: dict = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        client = threading.Thread(target=generate, args=(url, text, during), daemon=True)
        sent = time.monotonic()
        client.start()  # its step goes out to the frozen shard and stays out
        while health(url) != 503:
            assert time.monotonic() - sent < SHARD_STALL_S + HEARTBEAT_S + 3, "/health still 200 with a hung shard"
            time.sleep(0.2)
        unhealthy_after = time.monotonic() - sent
        assert unhealthy_after > SHARD_STALL_S - 1, "503 before the stall timeout: something else was missing"
        assert "status" not in during, during
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    while health(url) != 200:
        assert time.monotonic() - resumed < 10, "/health not 200 after the shard resumed"
        time.sleep(0.2)
    client.join(60)
    assert tokens(during) == expected, during
    assert tiny_server.pid("shard") == pid  # nobody restarted it: it just answered
    print(f"\nhung shard: 503 after {unhealthy_after:.1f} s, 200 {time.monotonic() - resumed:.1f} s after SIGCONT")
