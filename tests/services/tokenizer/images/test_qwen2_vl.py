"""Images through the tokenizer's Processor for a tiny Qwen2-VL (tests/vision_models.py), whose processor class needs
torchvision: its image processor and tokenizer alone give the reference processor's tokens (one <|image_pad|> per
merged patch, framed by <|vision_start|> <|vision_end|>) and pixels (its rows, shaped by their grid); an image its
resizing refuses gets a 422 in TGI's shape."""

from __future__ import annotations

import numpy as np
import pytest

from libs.protocol import codec
from libs.protocol.messages import RequestError, TokenizedRequest, image_pixels
from libs.runtime.settings import Settings
from services.shard.vision.pixels import PixelFinisher
from services.tokenizer.processor import Processor
from tests.services.tokenizer.conftest import request
from tests.vision_models import QWEN_MERGE, build_qwen_vl, data_uri, image, processed


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_qwen_vl(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")


@pytest.fixture(scope="module")
def vlm(qwen):
    return Processor.from_settings(Settings(model_path=str(qwen), max_input_tokens=200, max_total_tokens=300))


def test_markdown_images_become_framed_placeholders_and_grid_shaped_pixels(vlm, qwen):
    pics = [image(1), image(2, size=(24, 40))]
    out = vlm.process(request(f"Look ![]({data_uri(pics[0])}) and ![]({data_uri(pics[1])}) now", max_new_tokens=4))
    assert isinstance(out, TokenizedRequest), out
    want = processed(qwen, "Look <image> and <image> now", pics)
    assert out.input_ids.tolist() == want["input_ids"][0].tolist()  # framed image tokens, counted in the prompt
    grids = want["image_grid_thw"].tolist()
    assert [im.tokens for im in out.images] == [t * h * w // QWEN_MERGE**2 for t, h, w in grids] == [20, 15]
    assert [im.shape[:3] for im in out.images] == [[t, h // QWEN_MERGE, w // QWEN_MERGE] for t, h, w in grids]
    for im in out.images:  # framed: the token before and after the placeholders
        assert (out.input_ids[im.start : im.start + im.tokens] == vlm.images.image_token_id).all()
        assert out.input_ids[im.start - 1] != vlm.images.image_token_id != out.input_ids[im.start + im.tokens]
    # the rows as bytes before rescale and normalize, one temporal copy each (1/8 of the float32 rows' bytes)
    assert [im.dtype for im in out.images] == ["uint8"] * 2 and out.pixel_values is None
    assert out.pixel_bytes.nbytes * 4 * 2 == want["pixel_values"].numpy().nbytes
    back = codec.decode(codec.encode(out))
    assert np.array_equal(back.pixel_bytes, out.pixel_bytes) and back.images == out.images
    # which the shard finishes into the processor's rows, in order, bit for bit
    finisher = PixelFinisher(str(qwen))
    flat = image_pixels(back.images, back.pixel_values, back.pixel_bytes)
    rows = [finisher.values(im, px) for im, px in zip(back.images, flat)]
    assert [r.shape[:3] for r in rows] == [tuple(im.shape[:3]) for im in back.images]
    assert np.concatenate([r.ravel() for r in rows]).tobytes() == want["pixel_values"].numpy().ravel().tobytes()


def test_an_image_its_resizing_refuses_gets_a_422(vlm):
    out = vlm.process(request(f"![]({data_uri(image(1, size=(600, 2)))})", max_new_tokens=2))
    assert isinstance(out, RequestError) and out.error_type == "validation", out
    assert "aspect ratio" in out.message
    assert isinstance(vlm.process(request(f"![]({data_uri(image(1))})", max_new_tokens=2)), TokenizedRequest)
