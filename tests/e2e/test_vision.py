"""End to end on a tiny LLaVA (tests/vision_models.py) through the six processes: /info says it takes images; a
TGI markdown image on /generate and an OpenAI image_url part on /v1/chat/completions give transformers' greedy
tokens for the processor's inputs, image tokens counted in the prompt; two images give two answers; bad images get
a 422 in TGI's shape and the server keeps serving; the image metrics count."""

from __future__ import annotations

import base64
import time

import pytest
import requests

from tests.e2e.server import Server
from tests.vision_models import IMAGE_TOKENS, build_llava, image, processed, reference_generate

pytestmark = pytest.mark.e2e
MAX_NEW = 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def server(llava, tmp_path_factory):
    s = Server(llava, tmp_path_factory.mktemp("logs") / "vision-server.log", "--max-batch-total-tokens", "4096")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def generate(server, inputs: str) -> requests.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": True}}
    return requests.post(server.url + "/generate", json=body, timeout=60)


def test_info_says_images(server):
    info = requests.get(server.url + "/info", timeout=10).json()
    assert info["input_modalities"] == ["text", "image"] and info["model_pipeline_tag"] == "image-text-to-text"
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["input_modalities"] == ["text", "image"]


def test_generate_markdown_image_equals_transformers(server, llava):
    answers = {}
    for seed in (1, 2):
        r = generate(server, f"Look at ![]({uri(image(seed))}) and say")
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        ids, _ = processed(llava, "Look at <image> and say", [image(seed)])
        assert [t["id"] for t in details["prefill"]] == ids  # the image's placeholder tokens are prompt tokens
        answers[seed] = [t["id"] for t in details["tokens"]]
        assert answers[seed] == reference_generate(llava, "Look at <image> and say", [image(seed)], MAX_NEW)
    assert answers[1] != answers[2]


def test_chat_image_part_and_usage(server, llava):
    parts = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": uri(image(3))}}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": parts}], "max_tokens": MAX_NEW}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > IMAGE_TOKENS


def test_bad_images_get_4xx_and_the_server_keeps_serving(server):
    r = generate(server, f"![]({uri(b'not a picture')})")
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "not an image" in r.json()["error"]
    parts = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    # the chat route's validation errors keep TGI's shape, as its other 422s (tests/e2e/api/test_validation.py)
    assert r.status_code == 422 and "non-public address" in r.json()["error"], r.text
    assert generate(server, f"Again ![]({uri(image(4))})").status_code == 200
    # the processes' metrics reach /metrics with their heartbeats (once a second): poll until they are there
    deadline = time.monotonic() + 30
    while True:
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        if all(count(metrics, name) >= 1 for name in COUNTED) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {name: count(metrics, name) >= 1 for name in COUNTED} == dict.fromkeys(COUNTED, True), metrics


# images per request and preprocessing (tokenizer), encoder time (shard, observed by the scheduler)
COUNTED = (
    "switchyard_request_images_count",
    "switchyard_image_preprocess_seconds_count",
    "switchyard_image_encode_seconds_count",
)


def count(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))
