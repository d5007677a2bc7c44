"""A tiny LLaVA-Next served by the scheduler's Batcher and the shard's ModelRunner (the in-process engine, plans and
results encoded as on the bus): the tokenizer's placeholders are LlavaNextProcessor's own for pictures of different
sizes (anyres: their count follows the size), the encoder packs each image by its own size even in a batch of
same-shaped views, and greedy output is token-identical to transformers' generate() on the processor's inputs:
alone, batched with text-only rows and chunked, after preemption, and from a prefix-cache hit on the image
(scenarios.py)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from bench.engine import Engine
from libs.protocol.messages import FINISH_ERROR, image_pixels
from services.shard.vision.pixels import PixelFinisher
from services.tokenizer.images.processor import digest
from tests.services.shard.vision import scenarios
from tests.vision_models import build_llava_next, image, load, processed

WIDE, SQUARE, TALL = (40, 30), (30, 30), (24, 40)  # 5 views and 70 tokens, 5 views and 88, 3 views and 46


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    return scenarios.Family(
        build_llava_next(tmp_path_factory.mktemp("llava_next")), scenarios.prompts(TALL, SQUARE), num_blocks=96
    )


def test_placeholders_follow_the_size_and_the_encoder_packs_each_image_by_its_own(llava_next):
    req = llava_next.request("s", "<image> <image> <image>", [image(1), image(2, SQUARE), image(3, TALL)])
    sizes = processed(llava_next.folder, "<image>", [image(1)])["image_sizes"].tolist()
    assert [im.image_size for im in req.images] == [sizes[0], [30, 30], [40, 24]]  # (height, width)
    assert [im.tokens for im in req.images] == [70, 88, 46]
    assert [im.shape[0] for im in req.images] == [5, 5, 3]  # the base view and the grid's tiles
    # the size is part of the image's content hash: the same views from another size unpad to other rows
    flat = image_pixels(req.images, req.pixel_values, req.pixel_bytes)
    views = flat[0].reshape(req.images[0].shape)
    assert req.images[0].digest == digest(views, [30, 40]) != digest(views, [40, 30]) != digest(views)
    # the views travel as bytes before rescale and normalize; the shard's finish is the processor's, bit for bit
    assert [im.dtype for im in req.images] == ["uint8"] * 3 and req.pixel_values is None
    finisher = PixelFinisher(str(llava_next.folder))
    values = [finisher.values(im, px) for im, px in zip(req.images, flat)]
    for v, picture in zip(values, [image(1), image(2, SQUARE), image(3, TALL)]):
        assert v.tobytes() == processed(llava_next.folder, "<image>", [picture])["pixel_values"][0].numpy().tobytes()
    # the 40x30 and 30x30 pictures have the same views' shape: one batch, each packed by its own size
    model, _ = load(str(llava_next.folder))
    r = llava_next.runner()
    pixels = [torch.from_numpy(v) for v in values]
    batches, features = [], r.vision.encoder.features
    r.vision.encoder.features = lambda batch, images: batches.append(len(batch)) or features(batch, images)
    batched = r.vision.encoder.encode(pixels, req.images)
    assert sorted(batches) == [1, 2]
    for px, im, got in zip(pixels, req.images, batched):
        alone = model.model.get_image_features(
            pixel_values=px[None], image_sizes=torch.tensor([im.image_size]), return_dict=True
        ).pooler_output[0]
        assert got.shape == (im.tokens, 64) and torch.allclose(got, alone, atol=1e-5)
    with pytest.raises(ValueError, match="image_size"):  # a peer that dropped the size: refused, not guessed
        r.vision.encoder.encode(pixels[:1], [msgspec.structs.replace(req.images[0], image_size=[])])


def test_an_image_without_its_size_fails_its_request_alone(llava_next):
    """A sender older than ImageInput.image_size: the shard refuses that request when it opens it (the scheduler
    fails it on the reason), encodes nothing of it, and the step's other rows, an image and a text one, still give
    transformers' tokens."""
    runner = llava_next.runner()
    engine = Engine.build(runner, llava_next.folder)
    text, (plain, _) = llava_next.prompts[0][0], llava_next.prompts[3]
    old = llava_next.request("old", text, [image(1)])
    old.images = [msgspec.structs.replace(im, image_size=[]) for im in old.images]
    for req in (old, llava_next.request("new", text, [image(2)]), llava_next.request("plain", plain, [])):
        engine.add(req)
    out = engine.run()
    assert out["old"].finish == FINISH_ERROR and out["old"].tokens == []
    assert out["old"].error.startswith("image: ") and "image_size" in out["old"].error
    assert out["new"].tokens == llava_next.expected(text, [image(2)])
    assert out["plain"].tokens == llava_next.expected(plain, [])
    assert runner.vision.encoder.images == 1 and not runner.vision.cache.pending and not runner.vision.cache.outputs


def test_alone_equals_transformers_and_the_image_matters(llava_next):
    scenarios.alone(llava_next, llava_next.runner())


def test_concurrent_mixed_chunked(llava_next):
    scenarios.mixed(llava_next, llava_next.runner(160), chunk=24)  # placeholders fall across chunk boundaries


def test_after_preemption(llava_next):
    scenarios.after_preemption(llava_next, num_blocks=64)  # 256 slots


def test_prefix_hit_on_the_same_image_only(llava_next):
    scenarios.prefix_hit_on_the_same_image_only(llava_next)
