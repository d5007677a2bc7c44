"""kill -9 each role in turn, twice over, while 32 streaming greedy requests run: every request completes with
the tokens of an undisturbed run (transformers' generate() on the server's prompt ids; the http process's own
clients see their connection end at once), /health recovers, and the scheduler is left with nothing running and
every KV block free. Prints the recovery times."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.e2e.test_disconnects import assert_no_ghosts, settled
from tests.e2e.test_restarts import expected_tokens, stream, wait_healthy

pytestmark = pytest.mark.e2e

ROLES = ["detokenizer", "shard", "scheduler", "router", "tokenizer", "http"]
CONCURRENT = 32


def test_kill_each_role_under_load_twice(tiny_server, tiny_model_dir):
    url = tiny_server.url
    wait_healthy(url)
    texts = [f"soak request {i}: the {i % 5} brown foxes of round {i * 3 % 7}" for i in range(CONCURRENT)]
    expected = [expected_tokens(tiny_model_dir, t) for t in texts]
    report = []
    for rnd in range(2):
        for role in ROLES:
            wait_healthy(url, 90)
            outs = [{} for _ in texts]
            threads = [threading.Thread(target=stream, args=(url, t, o), daemon=True) for t, o in zip(texts, outs)]
            for th in threads:
                th.start()
            deadline = time.monotonic() + 60
            while sum(len(o.get("tokens", ())) > 0 for o in outs) < CONCURRENT // 4:
                errors = [o["error"] for o in outs if o.get("error")]
                assert time.monotonic() < deadline, f"round {rnd} {role}: the streams never started: {errors[:2]}"
                time.sleep(0.02)
            old = tiny_server.pid(role)
            killed = time.monotonic()
            os.kill(old, signal.SIGKILL)
            for th in threads:
                th.join(120)
            assert not any(th.is_alive() for th in threads), f"{role}: a stream hung"
            wait_healthy(url, 90)
            healthy = time.monotonic() - killed
            ended = max(o["ended"] for o in outs) - killed
            saved = sum(o["error"] is None and o["tokens"] == e for o, e in zip(outs, expected))
            report.append(
                f"round {rnd} {role:12s} saved {saved}/{CONCURRENT}  ended +{ended:.1f}s  healthy +{healthy:.1f}s"
            )
            print(report[-1], flush=True)
            if role != "http":
                assert saved == CONCURRENT, report[-1]
    print("\n" + "\n".join(report))
    assert_no_ghosts(settled(url, timeout=60))
