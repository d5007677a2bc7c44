"""A `kill -9` of the scheduler keeps the LoRA adapters changed at run time: a server started with one adapter has
it unloaded and another loaded while serving; a request streaming on the loaded adapter when the scheduler dies
finishes with peft's tokens (resubmitted to the restarted scheduler, never refused); afterwards the loaded adapter
still serves peft's output, the unloaded one is still unknown, the restarted scheduler logs the set it took over,
and the shard kept its weights (no reload, which it would log). A restarted http process lists the run-time
adapter in its very first answer (it reads the schedulers' record before any announcement reaches it)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.e2e.test_generate import WORDS
from tests.lora_adapters import base_model, build_adapter

peft = pytest.importorskip("peft")

CONFIGS = {
    "boot": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"]),
    "hot": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]),
}
PROMPT = " ".join(WORDS[(j * 5 + 1) % len(WORDS)] for j in range(30))  # no EOS in 150 tokens with "hot"
SHORT, LONG = 10, 150


def _until(check, what, within=60.0):
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _first_answer(url):
    """The first answer of a restarting server process to GET `url` (connection refusals retried)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return requests.get(url, timeout=10)
        except requests.ConnectionError:
            assert time.monotonic() < deadline, f"no answer from {url}"
            time.sleep(0.05)


def _generate(url, adapter, n=SHORT):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "details": True, "adapter_id": adapter}}
    return requests.post(url + "/generate", json=body, timeout=120)


def _stream(url, adapter, n, started, out):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "adapter_id": adapter}}
    with requests.post(url + "/generate_stream", json=body, stream=True, timeout=(5, 120)) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                assert "error" not in event, event
                out.append(event["token"]["id"])
                started.set()


def test_run_time_adapters_survive_a_scheduler_kill(tiny_model_dir, tmp_path):
    dirs = {name: build_adapter(tiny_model_dir, tmp_path / name, seed=70 + i, **cfg)
            for i, (name, cfg) in enumerate(CONFIGS.items())}  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ref = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), dirs["hot"], adapter_name="hot").eval()
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    want = {}
    for n in (SHORT, LONG):
        with torch.inference_mode():
            gen = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        want[n] = gen[0, ids.shape[1] :].tolist()
    assert len(want[LONG]) > 20  # a long enough stream to be cut by the kill

    flags = ["--lora-adapters", f"boot={dirs['boot']}", "--max-total-tokens", "512", "--max-input-tokens", "400"]
    # the killed scheduler leaves its traces in the log
    with Server(tiny_model_dir, tmp_path / "server.log", *flags, clean_log=False) as server:
        url = server.url
        r = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "boot"}, timeout=60)
        assert r.status_code == 200, r.text
        r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(dirs["hot"])},
                          timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        r = _generate(url, "hot")
        assert r.status_code == 200 and [t["id"] for t in r.json()["details"]["tokens"]] == want[SHORT]
        shard_lines = server.log_path.read_text().count("LoRA adapters loaded:")

        # kill -9 the scheduler while a request streams on the run-time adapter
        started, out = threading.Event(), []
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, url, "hot", LONG, started, out)
            assert started.wait(60)
            old = server.pid("scheduler")
            os.kill(old, signal.SIGKILL)
            _until(lambda: server.pid("scheduler") not in (0, old), "supervisord did not restart the scheduler")
            stream.result()
        assert out == want[LONG]  # resubmitted to the restarted scheduler, which still serves the adapter

        log = server.log_path.read_text()
        assert "LoRA adapters taken over from the previous scheduler: hot" in log
        _until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, "healthy again")
        r = _generate(url, "hot")
        assert r.status_code == 200 and [t["id"] for t in r.json()["details"]["tokens"]] == want[SHORT]
        r = _generate(url, "boot")
        assert r.status_code == 422 and "`boot` is not a loaded LoRA adapter" in r.json()["error"], r.text
        assert [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]][1:] == ["hot"]
        # the shard logs every change of its set: the restarted scheduler sent the one it already held
        assert server.log_path.read_text().count("LoRA adapters loaded:") == shard_lines

        old = server.pid("http")
        os.kill(old, signal.SIGKILL)
        _until(lambda: server.pid("http") not in (0, old), "supervisord did not restart http")
        r = _first_answer(url + "/v1/models")
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]][1:] == ["hot"], r.text
