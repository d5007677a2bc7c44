"""A pre-quantized checkpoint served end to end: a GPTQ (desc_act) build of the tiny Qwen2 model, its method read
from config.json, answers concurrent requests with the prompt log-probs and greedy tokens of transformers on its
dense float32 twin; a --quantize that contradicts the checkpoint stops the launcher with TGI's message."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.e2e.server import ROOT, Server
from tests.reference import _load, reference_generate
from tests.shard.quant_checkpoints import write
from tests.shard.test_quant import WEIGHT_ONLY_TOL

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


def test_a_gptq_checkpoint_is_served_like_its_twin(gptq_dirs, tmp_path):
    quant, twin = gptq_dirs
    server = Server(quant, tmp_path / "server.log", "--max-total-tokens", "256")
    try:
        server.wait_healthy()
        assert requests.get(server.url + "/info").json()["quantization"] == "gptq"

        def ask(prompt):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "decoder_input_details": True}}
            return requests.post(server.url + "/generate", json=body, timeout=120).json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one mixed batch of prefills and decodes
            answers = list(pool.map(ask, PROMPTS))
    finally:
        server.stop()
    tok, model = AutoTokenizer.from_pretrained(twin), _load(str(twin))
    for prompt, answer in zip(PROMPTS, answers):
        ids = tok(prompt).input_ids
        details = answer["details"]
        assert [t["id"] for t in details["tokens"]] == reference_generate(twin, ids, 8)[: len(details["tokens"])]
        with torch.inference_mode():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        got = [t["logprob"] for t in details["prefill"][1:]]
        assert got == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=TOL)


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
    server = Server(quant, tmp_path / "server.log", "--max-total-tokens", "256", "--num-shard", "2")
    try:
        server.wait_healthy()
        assert requests.get(server.url + "/info").json()["quantization"] == "gptq"
        assert server.env("shard", 1)["SWITCHYARD_NUM_SHARD"] == "2"

        def ask(prompt):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}}
            return requests.post(server.url + "/generate", json=body, timeout=120).json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, PROMPTS))
    finally:
        server.stop()
    tok = AutoTokenizer.from_pretrained(twin)
    for prompt, answer in zip(PROMPTS, answers):
        got = [t["id"] for t in answer["details"]["tokens"]]
        assert got == reference_generate(twin, tok(prompt).input_ids, 8)[: len(got)], prompt
