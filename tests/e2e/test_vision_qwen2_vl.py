"""End to end on a tiny Qwen2-VL (tests/vision_models.py) through the six processes: the tokenizer's image part of
its processor (no torchvision) and the shard's M-RoPE give transformers' greedy tokens for the processor's inputs on
/generate; two images give two answers; the same prompt again hits the prefix cache over its image (the image's place
travels on the bus without its pixels) and still answers as transformers does; /info says it takes images."""

from __future__ import annotations

import base64

import pytest
import requests

from tests.e2e.server import Server
from tests.e2e.test_generate import counter_rises, scheduler_counter
from tests.vision_models import build_qwen_vl, image, load_qwen_vl, qwen_processed, qwen_reference_generate

pytestmark = pytest.mark.e2e
MAX_NEW = 8
TEXT = "Look closely at <image> and then say what it is"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_qwen_vl(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")


@pytest.fixture(scope="module")
def server(qwen, tmp_path_factory):
    s = Server(qwen, tmp_path_factory.mktemp("logs") / "qwen2-vl-server.log", "--max-batch-total-tokens", "4096")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def generate(server, seed: int, prefill: bool = True) -> dict:
    """The answer's details; `prefill`: with the prompt's tokens (prompt logprobs: no prefix-cache lookup)."""
    md = TEXT.replace("<image>", "![](data:image/png;base64," + base64.b64encode(image(seed)).decode() + ")")
    body = {"inputs": md, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": prefill}}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["details"]


def test_info_says_images(server):
    assert requests.get(server.url + "/info", timeout=10).json()["input_modalities"] == ["text", "image"]


def test_markdown_image_equals_transformers_and_a_prefix_hit_too(server, qwen):
    answers, prompts = {}, {}
    for seed in (1, 2):
        details = generate(server, seed)
        prompts[seed] = qwen_processed(qwen, TEXT, [image(seed)])["input_ids"][0].tolist()
        assert [t["id"] for t in details["prefill"]] == prompts[seed]  # the framed image tokens are prompt tokens
        answers[seed] = [t["id"] for t in details["tokens"]]
        assert answers[seed] == qwen_reference_generate(qwen, TEXT, [image(seed)], MAX_NEW)
    assert answers[1] != answers[2]  # the image decides the answer
    hits = scheduler_counter(server.url, "prefix_hit_tokens")
    again = generate(server, 1, prefill=False)
    assert [t["id"] for t in again["tokens"]] == answers[1]
    # every full block of the prompt but the one holding its last token hits (blocks of 16), the image's with them
    ids, image_token = prompts[1], load_qwen_vl(str(qwen))[0].config.image_token_id
    covered = (len(ids) - 1) // 16 * 16
    assert covered >= len(ids) - ids[::-1].index(image_token)
    assert counter_rises(server.url, "prefix_hit_tokens", hits + covered - 1)
