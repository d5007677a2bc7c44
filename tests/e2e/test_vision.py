"""End to end on a tiny LLaVA (tests/vision_models.py) through the six processes: /info says it takes images; a
TGI markdown image on /generate and an OpenAI image_url part on /v1/chat/completions give transformers' greedy
tokens for the processor's inputs, image tokens counted in the prompt (and by /tokenize); two images give two
answers; bad images get a 422 in TGI's shape and the server keeps serving; the image metrics count; an image URL
that hangs holds up no text request through the one tokenizer."""

from __future__ import annotations

import http.server
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from libs.runtime.timeouts import STALL_S
from tests.e2e.vision_server import markdown_answers, serve
from tests.vision_models import IMAGE_TOKENS, build_llava, data_uri, image, prompt_ids

pytestmark = pytest.mark.e2e
SLOW_HOST = "127.0.0.2"  # a loopback address of its own: the server may fetch from it, not from 127.0.0.1
llava = serve(build_llava, "llava", "--allowed-media-domains", SLOW_HOST)


def test_info_says_images(llava):
    info = requests.get(llava.url + "/info", timeout=10).json()
    assert info["input_modalities"] == ["text", "image"] and info["model_pipeline_tag"] == "image-text-to-text"
    models = requests.get(llava.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["input_modalities"] == ["text", "image"]


def test_generate_markdown_image_equals_transformers(llava):
    markdown_answers(llava, "Look at <image> and say", [image(1), image(2)])


def test_tokenize_counts_an_image_as_its_tokens(llava):
    """/tokenize answers the prompt /generate prefills (its details.prefill: the processor's ids, as above)."""
    text = "Look at <image> and say"
    inputs = text.replace("<image>", f"![]({data_uri(image(1))})")
    r = requests.post(llava.url + "/tokenize", json={"inputs": inputs}, timeout=30)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()] == prompt_ids(llava.folder, text, [image(1)])
    assert sum(t["text"] == "<image>" for t in r.json()) == IMAGE_TOKENS


def test_chat_image_part_and_usage(llava):
    assert llava.chat_prompt_tokens(image(3), max_tokens=8) > IMAGE_TOKENS


def test_bad_images_get_4xx_and_the_server_keeps_serving(llava):
    r = llava.generate(f"![]({data_uri(b'not a picture')})")
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "not an image" in r.json()["error"]
    r = llava.chat([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}], max_tokens=2)
    # the chat route's validation errors keep TGI's shape, as its other 422s (tests/e2e/api/test_validation.py)
    assert r.status_code == 422 and "non-public address" in r.json()["error"], r.text
    assert llava.generate(f"Again ![]({data_uri(image(4))})").status_code == 200
    # the processes' metrics reach /metrics with their heartbeats (once a second): poll until they are there
    deadline = time.monotonic() + 30
    while True:
        metrics = requests.get(llava.url + "/metrics", timeout=10).text
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


def test_a_hanging_image_url_holds_up_no_text_request(llava):
    """The tokenizer fetches and preprocesses images off its loop (services/tokenizer/images/lane.py): while one
    request's image URL hangs, a text request through the same (only) tokenizer is answered, and the image request
    is answered once its picture comes. It waits past http's resubmission time (STALL_S) and is fetched once: the
    tokenizer's heartbeats name it as held."""
    asked, again, release = threading.Event(), threading.Event(), threading.Event()
    fetches = []
    picture = image(5)

    class Hanging(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            fetches.append(self.path)
            (again if asked.is_set() else asked).set()
            release.wait(30)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(picture)))
            self.end_headers()
            self.wfile.write(picture)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((SLOW_HOST, 0), Hanging)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(llava.generate, f"Look ![](http://{SLOW_HOST}:{server.server_address[1]}/cat.png)")
            assert asked.wait(30), "the tokenizer never fetched the image"
            r = llava.generate("Only text here", prefill=False)
            assert r.status_code == 200, r.text
            assert not slow.done(), "the image request ended before its picture came"
            # http resubmits what is not accepted after STALL_S unless something names it: a second fetch would be
            # a resubmitted copy preprocessed again
            assert not again.wait(2 * STALL_S + 1), f"the image was fetched again: {fetches}"
            release.set()
            assert slow.result().status_code == 200, slow.result().text
    finally:
        release.set()
        server.shutdown()
