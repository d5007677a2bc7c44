"""Multi-LoRA end to end: a server started with `--lora-adapters` serves base rows and three adapters mixed in one
concurrent batch, every row's greedy output equal to peft's own generate() (PeftModel with that adapter active,
float32, eager attention) token for token; again once the base model has cached the prompts' prefixes (the base
rows hit the prefix cache, the adapter rows do not), and again once the adapters have cached theirs. Unknown
adapters are errors on every route, and /v1/models and /info list the adapters."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.e2e.server import ROOT, Server
from tests.e2e.test_generate import WORDS, counter_in
from tests.lora_adapters import base_model, build_adapter
from tests.ports import free_port

peft = pytest.importorskip("peft")

ADAPTERS = {
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "qv_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
ROWS = [None, *ADAPTERS]  # None: the base model
MAX_NEW = 10
BLOCK = 16


def _prompt(i: int) -> str:
    """Distinct prompts (no two share a first block) of 40+ words: several full KV blocks each."""
    return " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(40 + 7 * i))


PROMPTS = [_prompt(i) for i in range(3)]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        name: build_adapter(tiny_model_dir, root / name, seed=10 + i, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapter_dirs):
    """(prompt, adapter) → peft's greedy new tokens, and the prompt ids (as /generate tokenizes them)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    names = list(ADAPTERS)
    ref = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        ref.load_adapter(adapter_dirs[name], adapter_name=name)
    ref.eval()
    out, ids = {}, {}
    for text in PROMPTS:
        ids[text] = tokenizer(text).input_ids
        input_ids = torch.tensor([ids[text]])
        for name in ROWS:
            kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_NEW, do_sample=False)
            with torch.inference_mode():
                if name is None:
                    with ref.disable_adapter():
                        gen = ref.generate(input_ids=input_ids, **kwargs)
                else:
                    ref.set_adapter(name)
                    gen = ref.generate(input_ids=input_ids, **kwargs)
            out[text, name] = gen[0, input_ids.shape[1] :].tolist()
    # the adapters really change the output, so equality can fail
    for text in PROMPTS:
        assert len({tuple(out[text, name]) for name in ROWS}) == len(ROWS), text
    return out, ids, tokenizer


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapter_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "lora-server.log"
    flags = ["--lora-adapters", ",".join(f"{name}={path}" for name, path in adapter_dirs.items())]
    with Server(
        tiny_model_dir, log, *flags, "--max-total-tokens", "512", "--max-input-tokens", "400", clean_log=False
    ) as server:  # the unknown-adapter test provokes errors on purpose
        yield server


def _generate(url: str, text: str, adapter: str | None) -> list[int]:
    parameters = {"max_new_tokens": MAX_NEW, "details": True, **({"adapter_id": adapter} if adapter else {})}
    r = requests.post(url + "/generate", json={"inputs": text, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def _fresh_counters(url: str, generated_at_least: int) -> dict[str, int]:
    """The scheduler's counters once its heartbeat has counted every token generated so far (they travel in
    heartbeats, once a second): then the prefix counters include every request sent."""
    deadline = time.monotonic() + 30
    while counter_in(text := requests.get(url + "/metrics", timeout=10).text, "generated") < generated_at_least:
        assert time.monotonic() < deadline, "the scheduler's counters did not catch up"
        time.sleep(0.2)
    names = ("generated", "prefix_hit_tokens", "lora_prefix_hit_tokens", "lora_generated")
    return {name: counter_in(text, name) for name in names}  # all from the render that counted every token


def _mixed_batch(url: str, want: dict) -> dict:
    """Every (prompt, row) at once; each answer checked against peft."""
    cases = [(text, name) for text in PROMPTS for name in ROWS]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = dict(zip(cases, pool.map(lambda case: _generate(url, *case), cases)))
    for case in cases:
        assert got[case] == want[case], f"adapter {case[1]!r} on prompt {case[0][:30]!r}"
    return got


def _full_blocks(prompt_ids: list[int]) -> int:
    """Prompt tokens a prefix hit can cover: the full blocks before the last prompt token (which is always fed)."""
    return (len(prompt_ids) - 1) // BLOCK * BLOCK


def test_mixed_adapters_equal_peft_and_keep_their_own_prefix_cache(lora_server, expected):
    want, ids, _ = expected
    url = lora_server.url
    assert re.search(r"LoRA adapters loaded: all, qv_rs, mlp", lora_server.log_path.read_text())
    prompt_blocks = sum(_full_blocks(ids[text]) for text in PROMPTS)

    # 1. the base model alone caches every prompt's prefix
    total = 0
    for text in PROMPTS:
        tokens = _generate(url, text, None)
        assert tokens == want[text, None]
        total += len(tokens)
    start = _fresh_counters(url, total)
    assert start["lora_generated"] == 0

    # 2. base rows and three adapters over the same prompts, all at once: the base rows hit the base prefixes,
    # the adapter rows must not (their KV differs), and every row equals peft's
    got = _mixed_batch(url, want)
    total += sum(len(v) for v in got.values())
    mixed = _fresh_counters(url, total)
    # the base rows' hits (each admitted prompt is counted once; at least these)
    assert mixed["prefix_hit_tokens"] - start["prefix_hit_tokens"] >= prompt_blocks, (start, mixed)
    assert mixed["lora_prefix_hit_tokens"] == 0, ("an adapter row was served from another model's KV", mixed)
    assert mixed["lora_generated"] == sum(len(v) for (_, name), v in got.items() if name)  # the adapters ran

    # 3. the same batch again: now each adapter's rows hit that adapter's own cached prefixes, still equal to peft
    got = _mixed_batch(url, want)
    total += sum(len(v) for v in got.values())
    again = _fresh_counters(url, total)
    assert again["lora_prefix_hit_tokens"] >= len(ADAPTERS) * prompt_blocks, (mixed, again)
    assert again["prefix_hit_tokens"] - mixed["prefix_hit_tokens"] >= len(ROWS) * prompt_blocks, (mixed, again)


def test_openai_model_picks_the_adapter(lora_server, expected):
    want, _, tokenizer = expected
    text = PROMPTS[1]
    for name in ROWS:
        body = {"prompt": text, "max_tokens": MAX_NEW, "temperature": 0, "model": name or "tgi"}
        r = requests.post(lora_server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        decoded = tokenizer.decode(want[text, name], skip_special_tokens=True).replace("\ufffd", "")
        assert r.json()["choices"][0]["text"] == decoded, name


def test_unknown_adapter_is_an_error_on_every_route(lora_server, tiny_model_dir):
    url = lora_server.url
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "adapter_id": "nope"}}
    message = "Input validation error: `adapter_id` `nope` is not a loaded LoRA adapter (loaded: `all`, `qv_rs`, `mlp`)"
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 422 and r.json() == {"error": message, "error_type": "validation"}
    r = requests.post(url + "/generate_stream", json=body, timeout=60)  # TGI's stream: the error as its one event
    assert r.text.strip() == 'data: {"error":"' + message + '","error_type":"validation"}'
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "nope"}
    for route, request in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi", "model": "nope"})]:
        r = requests.post(url + route, json=request, timeout=60)
        assert r.status_code == 404, (route, r.text)
        error = r.json()["error"]  # OpenAI's shape
        assert error["message"] == "The model `nope` does not exist." and error["code"] == "model_not_found"
        assert error["type"] == "invalid_request_error"
    assert _generate(url, "hello", "mlp")  # and the server goes on serving

    models = requests.get(url + "/v1/models", timeout=10).json()["data"]
    base = str(tiny_model_dir)
    assert [(m["id"], m.get("parent")) for m in models] == [(base, None)] + [(name, base) for name in ADAPTERS]
    assert requests.get(url + "/info", timeout=10).json()["lora_adapters"] == list(ADAPTERS)


def _serve_exit(model_dir, *flags) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher", "serve", "--model-id", str(model_dir), "--port", str(free_port()), *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_bad_adapters_stop_the_launcher(tiny_model_dir, adapter_dirs, tmp_path):
    dora = tmp_path / "dora"
    shutil.copytree(adapter_dirs["all"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    cases = [
        (["--lora-adapters", "a=/x=y"], "error: Invalid LoRA adapter format: a=/x=y"),
        (
            ["--lora-adapters", f"d={dora}"],
            "error: LoRA adapter 'd': uses DoRA (use_dora: true), which is not supported",
        ),
        (["--lora-adapters", f"m={adapter_dirs['mlp']}", "--max-lora-rank", "8"], "is above the maximum LoRA rank 8"),
    ]
    for flags, message in cases:
        done = _serve_exit(tiny_model_dir, *flags)
        assert done.returncode == 1 and message in done.stderr, (flags, done.stderr[-2000:])
        assert "supervisord" not in done.stderr  # refused before any service started
