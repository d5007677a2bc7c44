"""End to end on a tiny Idefics3 (tests/vision_models.py) through the six processes: a markdown image becomes
Idefics3Processor's tiles (rows x columns and the global image, each a framed run of placeholders) as prompt tokens,
and /generate gives transformers' greedy tokens; two images give two answers; an OpenAI image_url part counts its
tiles' tokens in usage."""

from __future__ import annotations

import base64

import pytest
import requests

from tests.e2e.server import Server
from tests.vision_models import build_idefics3, idefics3_processed, idefics3_reference_generate, image

pytestmark = pytest.mark.e2e
MAX_NEW = 8
TEXT = "Look closely at <image> and then say what it is"


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return build_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def server(idefics3, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "idefics3-vision-server.log"
    s = Server(idefics3, log, "--max-batch-total-tokens", "4096")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_markdown_image_equals_transformers(server, idefics3):
    answers = {}
    for seed in (1, 2):
        md = TEXT.replace("<image>", f"![]({uri(image(seed))})")
        body = {"inputs": md, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": True}}
        r = requests.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prompt = idefics3_processed(idefics3, TEXT, [image(seed)])["input_ids"][0].tolist()
        assert [t["id"] for t in details["prefill"]] == prompt  # the tiles, their frames and markers: prompt tokens
        answers[seed] = [t["id"] for t in details["tokens"]]
        assert answers[seed] == idefics3_reference_generate(idefics3, TEXT, [image(seed)], MAX_NEW)
    assert answers[1] != answers[2]


def test_chat_image_part_counts_its_tiles(server, idefics3):
    parts = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": uri(image(3))}}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tiles = len(idefics3_processed(idefics3, "<image>", [image(3)])["input_ids"][0])  # the image's expansion alone
    assert r.json()["usage"]["prompt_tokens"] > tiles
