"""End to end on a tiny Qwen2-VL (tests/vision_models.py) through the six processes: the tokenizer's image part of
its processor (no torchvision) and the shard's M-RoPE give transformers' greedy tokens for the processor's inputs on
/generate; two images give two answers; the same prompt again hits the prefix cache over its image (the image's place
travels on the bus without its pixels) and still answers as transformers does; /info says it takes images."""

from __future__ import annotations

import functools

import pytest
import requests

from tests.e2e.test_generate import counter_rises, scheduler_counter
from tests.e2e.vision_server import markdown_answers, serve
from tests.vision_models import build_qwen_vl, data_uri, image, load

pytestmark = pytest.mark.e2e
TEXT = "Look closely at <image> and then say what it is"
qwen = serve(functools.partial(build_qwen_vl, family="qwen2_vl"), "qwen2_vl")


def test_info_says_images(qwen):
    assert requests.get(qwen.url + "/info", timeout=10).json()["input_modalities"] == ["text", "image"]


def test_markdown_image_equals_transformers_and_a_prefix_hit_too(qwen):
    (ids, answer), _ = markdown_answers(qwen, TEXT, [image(1), image(2)])  # the framed image tokens: prompt tokens
    hits = scheduler_counter(qwen.url, "prefix_hit_tokens")
    r = qwen.generate(TEXT.replace("<image>", f"![]({data_uri(image(1))})"), prefill=False)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == answer
    # every full block of the prompt but the one holding its last token hits (blocks of 16), the image's with them
    image_token = load(str(qwen.folder))[0].config.image_token_id
    covered = (len(ids) - 1) // 16 * 16
    assert covered >= len(ids) - ids[::-1].index(image_token)
    assert counter_rises(qwen.url, "prefix_hit_tokens", hits + covered - 1)
