"""A pre-quantized checkpoint served end to end: a GPTQ (desc_act) build of the tiny Qwen2 model, its method read
from config.json, answers concurrent requests with the prompt log-probs and greedy tokens of transformers on its
dense float32 twin, and rows of a LoRA adapter over it with peft's on the twin; a --quantize that contradicts the
checkpoint stops the launcher with TGI's message."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.e2e.server import ROOT, Server
from tests.reference import load_model, reference_generate
from tests.services.shard.quant.checkpoints import write
from tests.services.shard.quant.test_layers import WEIGHT_ONLY_TOL

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the launcher refuses --quantize where shards run on a GPU"),
]
PROMPTS = ["seven wizards quietly hum", "the quick brown fox jumps over", "old songs", "a lazy dog sleeps while"]
TOL = 2e-3 + WEIGHT_ONLY_TOL  # paged attention against eager (as test_api_params), plus the kernels' rounding


@pytest.fixture(scope="module")
def gptq_dirs(tiny_model_dir, tmp_path_factory):
    out = write(tiny_model_dir, tmp_path_factory.mktemp("gptq"), "gptq", bits=4, group=32, sym=False, desc_act=True)
    return out / "quant", out / "twin"


def _adapter_reference(twin, adapter, prompts: list[str], max_new: int) -> list[list[int]]:
    """peft's greedy new tokens over the dense twin with the adapter active (float32, eager attention)."""
    peft = pytest.importorskip("peft")
    from tests.lora_adapters import base_model

    tok = AutoTokenizer.from_pretrained(twin)
    model = peft.PeftModel.from_pretrained(base_model(twin), adapter).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt).input_ids])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def test_a_gptq_checkpoint_is_served_like_its_twin_with_and_without_an_adapter(gptq_dirs, tmp_path):
    """Base rows and rows of a LoRA adapter (built with peft on the twin) over the quantized linears, in one batch."""
    from tests.lora_adapters import build_adapter

    quant, twin = gptq_dirs
    adapter = build_adapter(twin, tmp_path / "adapter", seed=3, r=8, lora_alpha=16, target_modules="all-linear")
    flags = ("--max-total-tokens", "256", "--lora-adapters", f"ad={adapter}")
    with Server(quant, tmp_path / "server.log", *flags) as server:
        assert requests.get(server.url + "/info").json()["quantization"] == "gptq"

        def ask(case):
            prompt, adapter_id = case
            params = {"max_new_tokens": 8, "decoder_input_details": True, "adapter_id": adapter_id}
            return requests.post(server.url + "/generate", json={"inputs": prompt, "parameters": params}, timeout=120)

        cases = [(p, None) for p in PROMPTS] + [(p, "ad") for p in PROMPTS[:2]]
        with ThreadPoolExecutor(len(cases)) as pool:  # one mixed batch of prefills and decodes, base and adapter
            answers = [r.json() for r in pool.map(ask, cases)]
    tok, model = AutoTokenizer.from_pretrained(twin), load_model(str(twin))
    for prompt, answer in zip(PROMPTS, answers):
        ids = tok(prompt).input_ids
        details = answer["details"]
        assert [t["id"] for t in details["tokens"]] == reference_generate(twin, ids, 8)[: len(details["tokens"])]
        with torch.inference_mode():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        got = [t["logprob"] for t in details["prefill"][1:]]
        assert got == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=TOL)
    want = _adapter_reference(twin, adapter, PROMPTS[:2], 8)
    got = [[t["id"] for t in a["details"]["tokens"]] for a in answers[len(PROMPTS) :]]
    assert got == [w[: len(g)] for w, g in zip(want, got)]
    assert got != [[t["id"] for t in a["details"]["tokens"]] for a in answers[:2]]  # the adapter changed them


def test_a_mismatched_quantize_stops_the_launcher(gptq_dirs):
    quant, _ = gptq_dirs
    cmd = [sys.executable, "-m", "launcher", "serve", "--model-id", str(quant), "--quantize", "awq", "--port", "1"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "Quantization config mismatch: --quantize awq, but " in run.stderr and "'gptq'" in run.stderr


def test_a_gptq_checkpoint_over_two_shards(tiny_model_dir, tmp_path):
    """--num-shard 2: each shard holds half of every quantized layer (its scales and zeros split with it)."""
    out = write(tiny_model_dir, tmp_path / "ckpt", "gptq", bits=4, group=32, sym=False)
    quant, twin = out / "quant", out / "twin"
    with Server(quant, tmp_path / "server.log", "--max-total-tokens", "256", "--num-shard", "2") as server:
        assert requests.get(server.url + "/info").json()["quantization"] == "gptq"
        assert server.env("shard", 1)["SWITCHYARD_NUM_SHARD"] == "2"

        def ask(prompt):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}}
            return requests.post(server.url + "/generate", json=body, timeout=120).json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, PROMPTS))
    tok = AutoTokenizer.from_pretrained(twin)
    for prompt, answer in zip(PROMPTS, answers):
        got = [t["id"] for t in answer["details"]["tokens"]]
        assert got == reference_generate(twin, tok(prompt).input_ids, 8)[: len(got)], prompt
