"""End to end on a tiny Gemma 3 vision model (tests/vision_models.py) through the six processes: a markdown image
becomes Gemma3Processor's framed block of soft tokens, whose prefill attends both ways, and /generate gives
transformers' greedy tokens; two images give two answers."""

from __future__ import annotations

import base64

import pytest
import requests

from tests.e2e.server import Server
from tests.vision_models import build_gemma3, gemma3_processed, gemma3_reference_generate, image

pytestmark = pytest.mark.e2e
MAX_NEW = 8
TEXT = "Look closely at <start_of_image> and then say what it is"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def server(gemma3, tmp_path_factory):
    s = Server(gemma3, tmp_path_factory.mktemp("logs") / "gemma3-vision-server.log", "--max-batch-total-tokens", "4096")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_markdown_image_equals_transformers(server, gemma3):
    answers = {}
    for seed in (1, 2):
        md = TEXT.replace(
            "<start_of_image>", "![](data:image/png;base64," + base64.b64encode(image(seed)).decode() + ")"
        )
        body = {"inputs": md, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": True}}
        r = requests.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prompt = gemma3_processed(gemma3, TEXT, [image(seed)])["input_ids"][0].tolist()
        assert [t["id"] for t in details["prefill"]] == prompt  # the framed image block is prompt tokens
        answers[seed] = [t["id"] for t in details["tokens"]]
        assert answers[seed] == gemma3_reference_generate(gemma3, TEXT, [image(seed)], MAX_NEW)
    assert answers[1] != answers[2]
