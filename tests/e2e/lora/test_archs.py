"""Multi-LoRA end to end on a second architecture after test_lora.py's Qwen2: Gemma-3 (q/k norms, sliding + global
layers, its own MLP). A server started with `--lora-adapters` serves base rows and two adapters mixed in one
concurrent batch; every row's greedy output equals peft's own generate() (PeftModel with that adapter active,
float32, eager attention) token for token, and the scheduler counts the adapter rows' tokens (the adapters really
ran). Every tiny architecture (Llama, Qwen2, Gemma-2, Gemma-3) is checked against peft at the shard, through the
ModelRunner, in tests/services/shard/lora/test_model_runner.py: one server here instead of one per architecture."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.e2e.test_generate import WORDS, counter_now, scheduler_counter
from tests.lora_adapters import base_model, build_adapter
from tests.tiny_models import build_model

peft = pytest.importorskip("peft")

ADAPTERS = {
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "qv_mlp_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
}
ROWS = [None, *ADAPTERS]  # None: the base model
PROMPTS = [" ".join(WORDS[(i * 11 + j * 3) % len(WORDS)] for j in range(20 + 9 * i)) for i in range(2)]
MAX_NEW = 10


def reference_tokens(model_dir, dirs) -> dict:
    """(prompt, adapter) → peft's greedy new tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    names = list(dirs)
    ref = peft.PeftModel.from_pretrained(base_model(model_dir), dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        ref.load_adapter(dirs[name], adapter_name=name)
    ref.eval()
    out = {}
    for text in PROMPTS:
        ids = torch.tensor([tokenizer(text).input_ids])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        for name in ROWS:
            with torch.inference_mode():
                if name is None:
                    with ref.disable_adapter():
                        gen = ref.generate(input_ids=ids, **kwargs)
                else:
                    ref.set_adapter(name)
                    gen = ref.generate(input_ids=ids, **kwargs)
            out[text, name] = gen[0, ids.shape[1] :].tolist()
    for text in PROMPTS:  # the adapters really change the output, so equality can fail
        assert len({tuple(out[text, name]) for name in ROWS}) == len(ROWS), text
    return out


def generate(url: str, text: str, adapter: str | None) -> list[int]:
    parameters = {"max_new_tokens": MAX_NEW, "details": True, **({"adapter_id": adapter} if adapter else {})}
    r = requests.post(url + "/generate", json={"inputs": text, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


@pytest.mark.parametrize("arch", ["gemma3"])
def test_mixed_adapters_equal_peft(arch, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    model_dir = build_model(root / arch, arch)
    dirs = {name: build_adapter(model_dir, root / name, seed=50 + i, **cfg) for i, (name, cfg) in
            enumerate(ADAPTERS.items())}  # fmt: skip
    want = reference_tokens(model_dir, dirs)
    flags = ["--lora-adapters", ",".join(f"{name}={path}" for name, path in dirs.items())]
    with Server(
        model_dir, root / "server.log", *flags, "--max-total-tokens", "512", "--max-input-tokens", "400"
    ) as server:
        cases = [(text, name) for text in PROMPTS for name in ROWS]
        with ThreadPoolExecutor(len(cases)) as pool:
            got = dict(zip(cases, pool.map(lambda case: generate(server.url, *case), cases)))
        for case in cases:
            assert got[case] == want[case], f"{arch}: adapter {case[1]!r} on prompt {case[0][:30]!r}"
        # the scheduler counted every adapter row's tokens (its counters arrive with its heartbeat)
        adapter_tokens = sum(len(v) for (_, name), v in got.items() if name)
        deadline = time.monotonic() + 30
        while counter_now(server.url, "lora_generated") < adapter_tokens:
            assert time.monotonic() < deadline, "the scheduler counted fewer adapter tokens than were generated"
            time.sleep(0.2)
        assert scheduler_counter(server.url, "lora_generated") == adapter_tokens
