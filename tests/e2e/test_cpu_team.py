"""The exact mode holds whatever the OpenMP team: float32 greedy output equals transformers' generate() with the
shard's team at 1 thread and at 2 (--cpu-threads), the count read back from the shard's torch.get_num_threads()."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from transformers import AutoTokenizer

from libs.runtime import cpu_team
from tests.e2e.server import Server
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

PROMPTS = [
    "the quick brown fox jumps over",
    "seven wizards quietly hum old songs while a lazy dog sleeps by the fire",
    "a",
    "old songs old songs old songs",
]


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_equals_transformers_at_each_team_size(threads, tiny_model_dir, tmp_path):
    usable = cpu_team.usable_cpus()
    if len(usable) < threads:
        pytest.skip(f"{threads} threads need {threads} usable cores; this process has {len(usable)}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with Server(
        tiny_model_dir, tmp_path / "server.log", "--max-total-tokens", "512", "--cpu-threads", str(threads)
    ) as server:
        seen = re.findall(r"cpu team start: (\d+) threads \(torch.get_num_threads\(\) = (\d+)\)", server.tail(400))
        assert seen == [(str(threads), str(threads))], server.tail()

        def generate(i: int):
            body = {"inputs": PROMPTS[i], "parameters": {"max_new_tokens": 6 + 3 * i, "details": True}}
            r = requests.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: batched steps as well as single rows
            got = list(pool.map(generate, range(len(PROMPTS))))
        for i, ids in enumerate(got):
            assert ids == reference_generate(tiny_model_dir, tokenizer(PROMPTS[i]).input_ids, 6 + 3 * i)
