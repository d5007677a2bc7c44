"""`python -m launcher.tap` on a real server: it sees exactly the tokens and text a client receives,
filters by topic, and detaching leaves the server serving."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import defaultdict

import pytest
import requests

from tests.e2e.server import ROOT

pytestmark = pytest.mark.e2e


class Tap:
    def __init__(self, *args: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "launcher.tap", "--json", *args]
        env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.rows: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.attached = self.proc.stderr.readline()
        assert "# attached to" in self.attached, self.attached + self.proc.stderr.read()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.rows.put(json.loads(line))

    def until_final(self, n: int, timeout: float = 60.0) -> list[dict]:
        """Rows up to the n-th final text row."""
        got, finals = [], 0
        while finals < n:
            row = self.rows.get(timeout=timeout)
            got.append(row)
            finals += row["event"] == "text" and "final" in row
        return got

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(timeout=30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        assert "Traceback" not in self.proc.stderr.read()


def generate(url: str, text: str, n: int) -> dict:
    body = {"inputs": text, "parameters": {"max_new_tokens": n, "details": True}}
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def by_request(rows: list[dict]) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[r["request_id"]][r["event"]].append(r)
    return dict(out)  # insertion order: the order requests were first seen


def tap_rows(seen: dict) -> list[dict]:
    return [r for events in seen.values() for r in events["token"]]


def test_tap_sees_exactly_the_client_tokens(tiny_server):
    bus = f"ipc://{tiny_server.run_dir()}"
    tap, tokens_only = Tap("--bus", bus), Tap("--bus", bus, "--topic", "tok.")
    try:
        answers = [generate(tiny_server.url, p, n) for p, n in (("the quick brown fox", 12), ("seven wizards", 7))]
        seen = by_request(tap.until_final(2))
        n_tokens = sum(len(a["details"]["tokens"]) for a in answers)
        only = [tokens_only.rows.get(timeout=30) for _ in range(n_tokens)]
    finally:
        tap.stop()
        tokens_only.stop()
    assert len(seen) == 2
    assert all(len(events["Accepted"]) == 1 for events in seen.values())  # other events of a request show too
    assert only == tap_rows(seen)
    for events, answer in zip(seen.values(), answers):
        client_ids = [t["id"] for t in answer["details"]["tokens"]]
        assert [r["token_id"] for r in events["token"]] == client_ids
        assert [r["offset"] for r in events["token"]] == list(range(len(client_ids)))
        assert [r["index"] for r in events["text"]] == list(range(1, len(client_ids) + 1))
        assert "".join(r["text"] for r in events["text"]) == answer["generated_text"]
        assert events["text"][-1]["final"]["generated_text"] == answer["generated_text"]
    # detaching disturbed nothing
    assert requests.get(tiny_server.url + "/health", timeout=5).status_code == 200
