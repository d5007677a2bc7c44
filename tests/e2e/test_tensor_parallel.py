"""--num-shard 2: two shard processes (gloo) serve one replica; greedy output equals transformers' generate(),
and a rank that dies takes its peer down with it, both restart, and the server serves again."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

CASES = [
    ("seven wizards quietly hum old songs", 12),
    ("the quick brown fox jumps over a lazy dog while seven wizards hum", 16),
    ("old songs", 8),
    ("a lazy dog jumps over the quick brown fox " * 4, 10),
]


def generate(url: str, text: str, max_new: int) -> list[int]:
    body = {"inputs": text, "parameters": {"max_new_tokens": max_new, "details": True}}
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def check_greedy(server: Server, model_dir, tokenizer, cases=CASES) -> None:
    with ThreadPoolExecutor(len(cases)) as pool:  # concurrent: they share batches
        got = list(pool.map(lambda c: generate(server.url, *c), cases))
    for (text, n), ids in zip(cases, got):
        assert ids == reference_generate(model_dir, tokenizer(text).input_ids, n), text


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir, tmp_path_factory):
    flags = ("--max-total-tokens", "512", "--max-input-tokens", "400", "--num-shard", "2")
    with Server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "tp-server.log", *flags) as server:
        yield server


def test_two_shards_greedy_equals_generate(tp_server, tiny_model_dir):
    assert tp_server.env("shard", 0)["SWITCHYARD_INDEX"] == "0"
    assert tp_server.env("shard", 1)["SWITCHYARD_NUM_SHARD"] == "2"
    check_greedy(tp_server, tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert "all 2 ranks of replica 0 subscribed" in tp_server.tail(400)


def test_a_dead_rank_restarts_the_group(tp_server, tiny_model_dir):
    before = (tp_server.pid("shard", 0), tp_server.pid("shard", 1))
    os.kill(before[1], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # rank 0 sees rank 1 silent and exits too; supervisord restarts both
        try:
            now = (tp_server.pid("shard", 0), tp_server.pid("shard", 1))
        except Exception:
            now = (0, 0)
        if all(now) and now[0] != before[0] and now[1] != before[1]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the shards did not both restart:\n{tp_server.tail()}")
    tp_server.wait_healthy()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # prompts never seen: the new group computes right
    check_greedy(tp_server, tiny_model_dir, tokenizer, [("brown dogs hum " + text, n) for text, n in CASES])
    # the prompts served before the restart: their KV died with the shards, so no prefix-cache hit may use it
    check_greedy(tp_server, tiny_model_dir, tokenizer)
