"""LoRA adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter),
on a server started without adapters and with --api-key: a loaded adapter serves output equal to peft's token
for token; a bad adapter is a 400 naming the problem and disturbs nothing; an unload waits for the requests
running on the adapter, while concurrent base requests keep their outputs, and new requests get the
unknown-adapter errors at once; a reload under the same name with other weights never hits the old one's prefix
cache; a restarted shard reloads what was loaded at run time; the per-adapter metrics move."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.e2e.test_generate import WORDS, scheduler_counter
from tests.lora_adapters import base_model, build_adapter

peft = pytest.importorskip("peft")

KEY = "hot-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFIGS = {
    "first": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "second": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
}
PROMPT = " ".join(WORDS[(j * 3) % len(WORDS)] for j in range(40))  # two full KV blocks and more
BASE_PROMPTS = [" ".join(WORDS[(i + j * 7) % len(WORDS)] for j in range(12 + i)) for i in range(4)]
SHORT, LONG = 10, 120


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hot")
    out = {name: build_adapter(tiny_model_dir, root / name, seed=30 + i, **cfg) for i, (name, cfg) in
           enumerate(CONFIGS.items())}  # fmt: skip
    dora = root / "dora"
    shutil.copytree(out["first"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return {**out, "dora": dora}


@pytest.fixture(scope="module")
def want(tiny_model_dir, dirs):
    """(prompt, adapter folder name or None, max_new_tokens) → peft's (or the base model's) greedy tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ref = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), dirs["first"], adapter_name="first")
    ref.load_adapter(dirs["second"], adapter_name="second")
    ref.eval()
    out = {}

    def run(text, name, n):
        ids = torch.tensor([tokenizer(text).input_ids])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        with torch.inference_mode():
            if name is None:
                with ref.disable_adapter():
                    gen = ref.generate(input_ids=ids, **kwargs)
            else:
                ref.set_adapter(name)
                gen = ref.generate(input_ids=ids, **kwargs)
        out[text, name, n] = gen[0, ids.shape[1] :].tolist()

    for name in (None, "first", "second"):
        run(PROMPT, name, SHORT)
    run(PROMPT, "first", LONG)
    for text in BASE_PROMPTS:
        run(text, None, LONG)
    assert len({tuple(out[PROMPT, n, SHORT]) for n in (None, "first", "second")}) == 3  # equality can fail
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "lora-hot.log"
    flags = ["--api-key", KEY, "--max-total-tokens", "512", "--max-input-tokens", "400"]
    with Server(tiny_model_dir, log, *flags, clean_log=False) as server:  # bad adapters are refused on purpose
        yield server


def _post(url, route, body, headers=AUTH, timeout=120):
    return requests.post(url + route, json=body, headers=headers, timeout=timeout)


def _generate(url, text, adapter=None, n=SHORT):
    parameters = {"max_new_tokens": n, "details": True, **({"adapter_id": adapter} if adapter else {})}
    r = _post(url, "/generate", {"inputs": text, "parameters": parameters})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def _metric(url, pattern) -> float:
    m = re.search(pattern, requests.get(url + "/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else 0.0


def _until(check, what, within=30.0):
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _load(url, name, path, headers=AUTH):
    return _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, headers)


def _stream(url, text, adapter, n, started, out):
    body = {"inputs": text, "parameters": {"max_new_tokens": n, "adapter_id": adapter}}
    with requests.post(url + "/generate_stream", json=body, headers=AUTH, stream=True, timeout=(5, 120)) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                assert "error" not in event, event
                out.append(event["token"]["id"])
                started.set()
    out.append("end")


def test_hot_load_serve_unload_reload(server, dirs, want):
    url = server.url
    # the routes sit behind --api-key
    assert _load(url, "hot", dirs["first"], headers={}).status_code == 401
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "hot"}, headers={}).status_code == 401

    r = _load(url, "hot", dirs["first"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'hot' added successfully.", r.text
    _until(lambda: "LoRA adapter hot loaded from" in server.log_path.read_text(), "the scheduler's log line")
    assert _generate(url, PROMPT, "hot") == want[PROMPT, "first", SHORT]
    assert _generate(url, PROMPT) == want[PROMPT, None, SHORT]
    models = [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]]
    assert models[1:] == ["hot"]
    body = {"prompt": PROMPT, "max_tokens": SHORT, "temperature": 0, "model": "hot"}
    assert _post(url, "/v1/completions", body).status_code == 200
    # the metrics move: requests and tokens of the adapter, and one adapter loaded
    _until(lambda: _metric(url, r'^switchyard_lora_requests_total\{adapter="hot"[^}]*\} (\S+)') >= 2, "requests")
    generated = 2 * len(want[PROMPT, "first", SHORT])  # both requests (either may end at EOS)
    _until(lambda: _metric(url, r'^switchyard_lora_generated_tokens_total\{adapter="hot"[^}]*\} (\S+)') >= generated,
           "tokens")  # fmt: skip
    _until(lambda: _metric(url, r"^switchyard_lora_adapters_loaded\{[^}]*\} (\S+)") == 1, "gauge")

    # refused loads: the name taken, a bad adapter (named problem), a missing folder; the server goes on
    r = _load(url, "hot", dirs["second"])
    assert r.status_code == 400 and r.json()["message"] == "The lora adapter 'hot' has already been loaded."
    r = _load(url, "bad", dirs["dora"])
    assert r.status_code == 400 and "uses DoRA" in r.json()["message"], r.text
    assert r.json()["type"] == "BadRequestError"
    r = _load(url, "gone", "/nonexistent/adapter")
    assert r.status_code == 400 and "/nonexistent/adapter" in r.json()["message"], r.text
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert _generate(url, PROMPT, "hot") == want[PROMPT, "first", SHORT]
    assert [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]][1:] == ["hot"]

    # unload under load: a long request on the adapter and base requests run while the unload comes in
    started, hot_out = threading.Event(), []
    with ThreadPoolExecutor(8) as pool:
        hot = pool.submit(_stream, url, PROMPT, "hot", LONG, started, hot_out)
        bases = [pool.submit(_generate, url, text, None, LONG) for text in BASE_PROMPTS]
        assert started.wait(60)
        unload = pool.submit(_post, url, "/v1/unload_lora_adapter", {"lora_name": "hot"})
        unload.add_done_callback(lambda _: hot_out.append("unloaded"))
        r = unload.result()
        hot.result()
        assert [b.result() for b in bases] == [want[text, None, LONG] for text in BASE_PROMPTS]
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'hot' removed successfully.", r.text
    # the running request finished with every token, undisturbed. (Which the client sees first, the stream's last
    # events or the unload's answer, is a race between two connections: the last tokens take one hop more, through
    # the detokenizer. That the scheduler holds the unload until the adapter's rows are done is
    # tests/services/scheduler/test_lora.py's.)
    assert "unloaded" in hot_out and [t for t in hot_out if t != "unloaded"] == [*want[PROMPT, "first", LONG], "end"]
    # unknown again at once
    bad = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "adapter_id": "hot"}}
    assert _post(url, "/generate", bad).status_code == 422
    assert _post(url, "/v1/completions", body).status_code == 404
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "hot"})
    assert r.status_code == 404 and r.json()["message"] == "The lora adapter 'hot' cannot be found.", r.text
    _until(lambda: _metric(url, r"^switchyard_lora_adapters_loaded\{[^}]*\} (\S+)") == 0, "gauge back to 0")

    # the same name with other weights: peft's output of those, and no hit on the old adapter's cached prefix
    hits = scheduler_counter(url, "lora_prefix_hit_tokens")
    assert _load(url, "hot", dirs["second"]).status_code == 200
    assert _generate(url, PROMPT, "hot") == want[PROMPT, "second", SHORT]
    _until(lambda: _metric(url, r'^switchyard_lora_requests_total\{adapter="hot"[^}]*\} (\S+)') >= 4, "requests")
    assert scheduler_counter(url, "lora_prefix_hit_tokens") == hits, "a reloaded adapter hit stale KV"

    # a restarted shard reloads the adapters loaded at run time
    old = server.pid("shard")
    os.kill(old, signal.SIGKILL)
    _until(lambda: server.pid("shard") not in (0, old), "supervisord did not restart the shard", 90)
    _until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, "healthy again", 120)
    assert _generate(url, PROMPT, "hot") == want[PROMPT, "second", SHORT]

    # a restarted tokenizer learns the run-time adapters from the schedulers' announcements (the request waits in
    # http while it restarts, then in the tokenizer for the announcement: never a 422)
    old = server.pid("tokenizer")
    os.kill(old, signal.SIGKILL)
    _until(lambda: server.pid("tokenizer") not in (0, old), "supervisord did not restart the tokenizer", 90)
    assert _generate(url, PROMPT, "hot") == want[PROMPT, "second", SHORT]


def test_hot_load_on_two_tensor_parallel_ranks(tiny_model_dir, dirs, want, tmp_path):
    """--num-shard 2: both ranks load their slices before the route answers (the scheduler waits for both acks),
    so the output equals peft's; a bad adapter is refused by the ranks; unload drops it from both."""
    flags = ["--api-key", KEY, "--max-total-tokens", "512", "--max-input-tokens", "400", "--num-shard", "2"]
    with Server(tiny_model_dir, tmp_path / "tp.log", *flags, clean_log=False) as server:
        url = server.url
        r = _load(url, "tp", dirs["first"])
        assert r.status_code == 200, r.text
        # one line per rank (the launcher relays the shards' logs a moment later)
        _until(lambda: server.log_path.read_text().count("LoRA adapters loaded: tp") == 2, "both ranks loaded it")
        assert _generate(url, PROMPT, "tp") == want[PROMPT, "first", SHORT]
        assert _generate(url, PROMPT) == want[PROMPT, None, SHORT]
        r = _load(url, "bad", dirs["dora"])
        assert r.status_code == 400 and "uses DoRA" in r.json()["message"], r.text
        assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "tp"}).status_code == 200
        _until(lambda: server.log_path.read_text().count("LoRA adapters loaded: none") == 2, "both ranks dropped it")
        assert _post(url, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "tp"}}).status_code == 422
