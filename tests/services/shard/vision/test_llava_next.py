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
    views = req.pixel_values[: req.images[0].size].reshape(req.images[0].shape)
    assert req.images[0].digest == digest(views, [30, 40]) != digest(views, [40, 30]) != digest(views)
    # the 40x30 and 30x30 pictures have the same views' shape: one batch, each packed by its own size
    model, _ = load(str(llava_next.folder))
    r = llava_next.runner()
    pixels, at = [], 0
    for im in req.images:
        pixels.append(torch.from_numpy(req.pixel_values[at : at + im.size].reshape(im.shape)))
        at += im.size
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


def test_alone_equals_transformers_and_the_image_matters(llava_next):
    scenarios.alone(llava_next, llava_next.runner())


def test_concurrent_mixed_chunked(llava_next):
    scenarios.mixed(llava_next, llava_next.runner(160), chunk=24)  # placeholders fall across chunk boundaries


def test_after_preemption(llava_next):
    scenarios.after_preemption(llava_next, num_blocks=64)  # 256 slots


def test_prefix_hit_on_the_same_image_only(llava_next):
    scenarios.prefix_hit_on_the_same_image_only(llava_next)
