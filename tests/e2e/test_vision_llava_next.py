"""End to end on a tiny LLaVA-Next (tests/vision_models.py) through the six processes: markdown images of two sizes
become LlavaNextProcessor's placeholders, as many as each size gives (anyres), and /generate gives transformers'
greedy tokens; two images give two answers."""

from __future__ import annotations

import base64

import pytest
import requests

from tests.e2e.server import Server
from tests.vision_models import build_llava_next, image, llava_next_processed, llava_next_reference_generate

pytestmark = pytest.mark.e2e
MAX_NEW = 8
TEXT = "Look closely at <image> and then say what it is"


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    return build_llava_next(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def server(llava_next, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "llava-next-vision-server.log"
    s = Server(llava_next, log, "--max-batch-total-tokens", "4096")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_markdown_images_of_two_sizes_equal_transformers(server, llava_next):
    answers, placeholders = [], []
    for picture in (image(1), image(2, (24, 40))):
        md = TEXT.replace("<image>", "![](data:image/png;base64," + base64.b64encode(picture).decode() + ")")
        body = {"inputs": md, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": True}}
        r = requests.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prompt = llava_next_processed(llava_next, TEXT, [picture])["input_ids"][0].tolist()
        assert [t["id"] for t in details["prefill"]] == prompt  # the image's placeholders are prompt tokens
        placeholders.append(len(prompt))
        answers.append([t["id"] for t in details["tokens"]])
        assert answers[-1] == llava_next_reference_generate(llava_next, TEXT, [picture], MAX_NEW)
    assert placeholders[0] != placeholders[1]  # 40x30 and 24x40: 70 and 46 placeholders
    assert answers[0] != answers[1]
