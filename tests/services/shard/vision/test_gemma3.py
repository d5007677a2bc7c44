"""A tiny Gemma 3 vision model served by the scheduler's Batcher and the shard's ModelRunner: greedy output
token-identical to transformers' generate() on its real Gemma3Processor's inputs, alone, 8 mixed with text-only
rows (whole and chunked without splitting an image), after preemption and from a prefix hit on the image
(scenarios.py); an image's tokens attend to each other both ways in prefill (a causal-only mask gives other tokens),
also where the sliding window is narrower than an image; the tokenizer's path places the image on its soft tokens,
its pixels sent as bytes that the shard finishes into the processor's values bit for bit."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest

from bench.engine import Engine, request
from libs.protocol.messages import ImageInput, image_pixels
from services.scheduler.images import whole_image_chunk
from services.shard.vision import loader as vision_loader
from services.shard.vision.pixels import PixelFinisher
from tests.services.shard.vision import scenarios
from tests.vision_models import build_gemma3, image, processed

IMG = "<start_of_image>"


def placed_by_the_processor(model_dir, rid: str, text: str, pictures: list[bytes], max_new: int):
    """The request from the processor's own ids and pixels: each image's block of image tokens placed."""
    inputs = processed(model_dir, text, pictures)
    req = request(rid, inputs["input_ids"][0].tolist(), max_new)
    if pictures:
        kinds = inputs["token_type_ids"][0].numpy()
        starts = np.flatnonzero(np.diff(np.concatenate([[0], kinds])) == 1)
        pixels = inputs["pixel_values"].numpy().astype(np.float32)
        tokens = int(kinds.sum()) // len(pictures)
        req.images = [
            ImageInput(
                digest=hashlib.sha256(px.tobytes()).hexdigest(), start=int(s), tokens=tokens, shape=list(px.shape)
            )
            for s, px in zip(starts, pixels)
        ]
        req.pixel_values = np.concatenate([px.ravel() for px in pixels])
    return req


def family(model_dir) -> scenarios.Family:
    return scenarios.Family(
        model_dir,
        scenarios.prompts(placeholder=IMG),
        placeholder=IMG,
        make=functools.partial(placed_by_the_processor, model_dir),
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return family(build_gemma3(tmp_path_factory.mktemp("gemma3")))


def test_alone_equals_transformers_and_the_image_matters(gemma3):
    scenarios.alone(gemma3, gemma3.runner())


def test_a_causal_only_mask_gives_other_tokens(gemma3, monkeypatch):
    monkeypatch.setattr(vision_loader, "attends_images_both_ways", lambda model: False)
    engine = Engine.build(gemma3.runner(), gemma3.folder)
    for i, (text, pictures) in enumerate(gemma3.prompts):
        engine.add(gemma3.request(f"c{i}", text, pictures))
    out = engine.run()
    wrong = [
        i
        for i, (text, pictures) in enumerate(gemma3.prompts)
        if pictures and out[f"c{i}"].tokens != gemma3.expected(text, pictures)
    ]
    assert wrong  # the bidirectional image block decides tokens here


def test_concurrent_mixed(gemma3):
    scenarios.mixed(gemma3, gemma3.runner())


def test_concurrent_chunked_keeps_each_image_whole(gemma3):
    # a chunk that would end inside an image's block stops before it or takes it whole
    scenarios.mixed(gemma3, gemma3.runner(), chunk=10, whole_images=True)


def test_a_window_narrower_than_an_image_cuts_its_block(tmp_path):
    narrow = family(build_gemma3(tmp_path, sliding_window=3))  # 4-token images: the sliding layers see 3 of them
    scenarios.mixed(narrow, narrow.runner(), chunk=10, whole_images=True)


def test_a_chunk_never_ends_inside_an_image():
    req = request("w", list(range(30)), 1)
    req.images = [ImageInput(digest="d", start=8, tokens=4, shape=[1])]
    assert whole_image_chunk(req, 0, 10) == 8  # stops before the image
    assert whole_image_chunk(req, 8, 2) == 4  # begins at it: takes it whole
    assert whole_image_chunk(req, 9, 1) == 3  # begins inside it (a prefix hit): its rest
    assert whole_image_chunk(req, 0, 12) == 12 and whole_image_chunk(req, 0, 5) == 5


def test_after_preemption(gemma3):
    scenarios.after_preemption(gemma3, num_blocks=24)


def test_prefix_hit_on_the_same_image_only(gemma3):
    scenarios.prefix_hit_on_the_same_image_only(gemma3)


def test_the_tokenizer_places_the_soft_tokens_inside_the_frame(gemma3):
    """The tokenizer service's path (markdown image → <start_of_image> → the processor's framed block) gives the
    processor's ids, the image placed on its soft tokens (not the frame), and the reference's answer."""
    text = gemma3.prompts[0][0]
    got = gemma3.admitted("tok", text, [image(3)])  # its ids: the processor's
    want = gemma3.request("want", text, [image(3)])
    assert [(p.start, p.tokens) for p in got.images] == [(p.start, p.tokens) for p in want.images]
    # its pixels travel as bytes before rescale and normalize; the shard's finish is the processor's, bit for bit
    assert [p.dtype for p in got.images] == ["uint8"] and got.pixel_values is None
    (flat,) = image_pixels(got.images, got.pixel_values, got.pixel_bytes)
    assert PixelFinisher(str(gemma3.folder)).values(got.images[0], flat).tobytes() == want.pixel_values.tobytes()
    engine = Engine.build(gemma3.runner(), gemma3.folder)
    engine.add(got)
    assert engine.run()["tok"].tokens == gemma3.expected(text, [image(3)])
