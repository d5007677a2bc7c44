"""Images through the tokenizer's Processor for a tiny LLaVA (tests/vision_models.py): markdown images and OpenAI
image parts become the processor's own placeholder tokens and pixels; bad images, too many of them, non-public
URLs and slow servers get a 422 in TGI's shape; a text-only model refuses image parts."""

from __future__ import annotations

import http.server
import io
import socket
import threading

import numpy as np
import pytest

from libs.protocol import codec
from libs.protocol.messages import RequestError, TokenizedRequest, image_pixels
from libs.runtime.settings import Settings
from services.shard.vision.pixels import PixelFinisher
from services.tokenizer.processor import Processor
from tests.services.tokenizer.conftest import request
from tests.vision_models import IMAGE_TOKENS, build_llava, data_uri, image, processed

PREFIX = "Input validation error: "


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


def processor(llava, **settings) -> Processor:
    return Processor.from_settings(
        Settings(model_path=str(llava), max_input_tokens=200, max_total_tokens=300, **settings)
    )


@pytest.fixture(scope="module")
def vlm(llava):
    return processor(llava)


def error(result) -> str:
    assert isinstance(result, RequestError) and result.error_type == "validation", result
    return result.message.removeprefix(PREFIX)


def test_markdown_images_become_the_processors_tokens_and_pixels(vlm, llava):
    pics = [image(1), image(2, fmt="JPEG")]
    out = vlm.process(
        request(f"Look ![]({data_uri(pics[0])}) and ![]({data_uri(pics[1], 'image/jpeg')}) now", max_new_tokens=4)
    )
    assert isinstance(out, TokenizedRequest)
    want = processed(llava, "Look <image> and <image> now", pics)
    assert out.input_ids.tolist() == want["input_ids"][0].tolist()  # image tokens counted as prompt tokens
    assert [im.tokens for im in out.images] == [IMAGE_TOKENS] * 2
    assert all((out.input_ids[im.start : im.start + im.tokens] == vlm.images.image_token_id).all() for im in out.images)
    assert out.images[0].digest != out.images[1].digest
    back = codec.decode(codec.encode(out))  # pixels travel as a raw frame, dtype and shapes in the message
    assert np.array_equal(back.pixel_bytes, out.pixel_bytes) and back.images == out.images
    # as bytes before rescale and normalize (a quarter of float32's), which the shard finishes bit for bit
    assert [im.dtype for im in back.images] == ["uint8"] * 2 and back.pixel_bytes.nbytes == want["pixel_values"].numel()
    assert back.pixel_values.size == 0
    assert finished(back, llava).tobytes() == want["pixel_values"].numpy().tobytes()


def finished(req: TokenizedRequest, folder) -> np.ndarray:
    """The request's images' float32 pixel values as the shard gets them (services/shard/vision/pixels.py)."""
    finisher = PixelFinisher(str(folder))
    flat = image_pixels(req.images, req.pixel_values, req.pixel_bytes)
    values = np.stack([finisher.values(im, px) for im, px in zip(req.images, flat)])
    assert values.dtype == np.float32
    return values


def test_openai_image_parts_webp_and_gif(vlm, llava):
    for fmt, mime in (("WEBP", "image/webp"), ("GIF", "image/gif")):
        parts = [
            {"type": "text", "text": "What is "},
            {"type": "image_url", "image_url": {"url": data_uri(image(3, fmt=fmt), mime)}},
        ]
        out = vlm.process(request("", messages=[{"role": "user", "content": parts}], max_new_tokens=4))
        assert isinstance(out, TokenizedRequest), out
        assert len(out.images) == 1 and out.images[0].tokens == IMAGE_TOKENS


def test_the_same_image_has_the_same_digest(vlm):
    a, b = (vlm.process(request(f"![]({data_uri(image(5))})", max_new_tokens=2)) for _ in range(2))
    assert a.images[0].digest == b.images[0].digest


def test_bad_images_are_refused(llava, vlm):
    png = image(1)
    assert "not an image" in error(vlm.process(request(f"![]({data_uri(b'hello world')})", max_new_tokens=2)))
    assert "decoded" in error(vlm.process(request(f"![]({data_uri(png[: len(png) // 2])})", max_new_tokens=2)))
    assert "base64" in error(vlm.process(request("![](data:image/png;base64,@@@)", max_new_tokens=2)))
    small = processor(llava, max_image_pixels=100, max_images_per_request=2, max_image_bytes=len(png) - 1)
    assert "over the limit of 100 pixels" in error(
        small.process(request(f"![]({data_uri(image(1, size=(20, 20)))})", max_new_tokens=2))
    )
    assert "over the limit" in error(small.process(request(f"![]({data_uri(png)})", max_new_tokens=2)))
    three = "".join(f"![]({data_uri(image(1, size=(4, 4)))})" for _ in range(3))
    assert "at most 2 images" in error(small.process(request(three, max_new_tokens=2)))
    assert "scheme" in error(vlm.process(request("![](file:///etc/passwd)", max_new_tokens=2)))


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = image(9)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_urls_to_private_addresses_need_allowing(llava, vlm, image_server):
    msg = error(vlm.process(request(f"![]({image_server}/cat.png)", max_new_tokens=2)))
    assert "non-public address" in msg and "--allowed-media-domains" in msg
    allowed = processor(llava, allowed_media_domains="127.0.0.1")
    for path in ("/cat.png", "/redirect"):
        out = allowed.process(request(f"A ![]({image_server}{path})", max_new_tokens=2))
        assert isinstance(out, TokenizedRequest), out
        assert (
            out.images[0].digest
            == vlm.process(request(f"A ![]({data_uri(image(9))})", max_new_tokens=2)).images[0].digest
        )


def test_a_url_that_times_out(llava):
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        slow = processor(llava, allowed_media_domains="127.0.0.1", image_fetch_timeout_s=0.3)
        msg = error(slow.process(request(f"![](http://127.0.0.1:{silent.getsockname()[1]}/x.png)", max_new_tokens=2)))
        assert "longer than 0.3 s" in msg
    finally:
        silent.close()


def test_a_text_only_model_refuses_image_parts(processor_text):
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image(1))}}]
    assert "does not take images" in error(
        processor_text.process(request("", messages=[{"role": "user", "content": parts}], max_new_tokens=2))
    )


@pytest.fixture(scope="module")
def processor_text(settings):
    return Processor.from_settings(settings.replace(max_input_tokens=200, max_total_tokens=300))


# llava-hf/llava-1.5-7b-hf's chat template: it loops over content parts and writes `<image>` for an image part
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def test_image_parts_through_the_models_own_template(llava):
    """LLaVA's template writes its image token for each image part: each becomes that image's tokens, as
    transformers' processor.apply_chat_template and the processor give them."""
    from PIL import Image
    from transformers import AutoProcessor

    pics = [image(7), image(8)]
    parts = [
        {"type": "image_url", "image_url": {"url": data_uri(pics[0])}},
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_uri(pics[1])}},
    ]
    vlm = processor(llava, chat_template=LLAVA_TEMPLATE)
    out = vlm.process(request("", messages=[{"role": "user", "content": parts}], max_new_tokens=4))
    assert isinstance(out, TokenizedRequest), out
    hf = AutoProcessor.from_pretrained(str(llava))
    hf_parts = [{"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"}]
    text = hf.apply_chat_template(
        [{"role": "user", "content": hf_parts}], chat_template=LLAVA_TEMPLATE, add_generation_prompt=True
    )
    assert text == "USER: <image>\n<image>\nCompare ASSISTANT:"
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in pics]
    want = hf(text=text, images=pil, add_special_tokens=False, return_tensors="np")
    assert out.input_ids.tolist() == want["input_ids"][0].tolist()
    assert [im.tokens for im in out.images] == [IMAGE_TOKENS] * 2  # the feature fired: two images placed
    assert finished(out, llava).tobytes() == want["pixel_values"].tobytes()
    # a template that drops image parts is refused, not served without the image
    blind = processor(
        llava,
        chat_template="{% for m in messages %}{% for c in m['content'] %}{{ c.get('text', '') }}"
        "{% endfor %}{% endfor %}",
    )
    assert "did not place 2" in error(
        blind.process(request("", messages=[{"role": "user", "content": parts}], max_new_tokens=4))
    )


def test_tokenize_expands_images_as_generation_does(vlm, llava):
    """/tokenize and /chat_tokenize answer the tokens a prefill feeds: each image as its placeholder tokens, each of
    them with the text and offsets of the image token standing where the image was."""
    inputs = f"Look ![]({data_uri(image(1))}) now"
    tokens = vlm.process(request(inputs, mode="tokenize"))
    generated = vlm.process(request(inputs, max_new_tokens=2))
    assert (
        tokens.ids.tolist()
        == generated.input_ids.tolist()
        == processed(llava, "Look <image> now", [image(1)])["input_ids"][0].tolist()
    )
    assert tokens.text == "Look <image> now"
    at = np.flatnonzero(tokens.ids == vlm.images.image_token_id)
    assert len(at) == IMAGE_TOKENS
    assert {tokens.text[a:b] for a, b in zip(tokens.starts[at], tokens.stops[at])} == {"<image>"}
    assert tokens.stops[-1] == len(tokens.text)  # the text after the image keeps its offsets in that text
    parts = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": data_uri(image(2))}}]
    messages = [{"role": "user", "content": parts}]
    chat = vlm.process(request("", messages=messages, mode="tokenize"))
    assert chat.ids.tolist() == vlm.process(request("", messages=messages, max_new_tokens=2)).input_ids.tolist()
    assert (chat.ids == vlm.images.image_token_id).sum() == IMAGE_TOKENS
    assert "not an image" in error(vlm.process(request(f"![]({data_uri(b'junk')})", mode="tokenize")))


def test_tokenize_on_a_text_only_model_treats_images_as_generation_does(processor_text):
    """A markdown image stays text (TGI); an OpenAI image part is refused with the same 422."""
    inputs = "A ![](https://example.com/cat.png)"
    tokens = processor_text.process(request(inputs, mode="tokenize"))
    assert tokens.ids.tolist() == processor_text.process(request(inputs, max_new_tokens=2)).input_ids.tolist()
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image(1))}}]
    refused = processor_text.process(request("", messages=[{"role": "user", "content": parts}], mode="tokenize"))
    assert "does not take images" in error(refused)
