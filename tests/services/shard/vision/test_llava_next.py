"""A tiny LLaVA-Next served by the scheduler's Batcher and the shard's ModelRunner (the in-process engine, plans and
results encoded as on the bus): the tokenizer's placeholders are LlavaNextProcessor's own for pictures of different
sizes (anyres: their count follows the size), the encoder packs each image by its own size even in a batch of
same-shaped views, and greedy output is token-identical to transformers' generate() on the processor's inputs:
alone, batched with text-only rows and chunked, after preemption, and from a prefix-cache hit on the image."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest
import torch

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner
from services.tokenizer.images.fetch import FetchLimits
from services.tokenizer.images.processor import ImageLimits, ImageProcessor, digest
from tests.vision_models import (
    build_llava_next,
    image,
    llava_next_processed,
    llava_next_reference_generate,
    load_llava_next,
)

MAX_NEW = 8
WIDE, SQUARE, TALL = (40, 30), (30, 30), (24, 40)  # 5 views and 70 tokens, 5 views and 88, 3 views and 46


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    folder = build_llava_next(tmp_path_factory.mktemp("llava_next"))
    return folder, ImageProcessor(str(folder), ImageLimits(fetch=FetchLimits()))


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def vision_request(llava_next, rid: str, text: str, pictures: list[bytes], max_new=MAX_NEW):
    """The request as the tokenizer admits it: markdown images → `<image>` → the processor's placeholders, as many
    as the image's size gives; its ids must be the processor's own on the whole prompt."""
    folder, images = llava_next
    md = text.replace("<image>", "![]({})").format(*(data_uri(p) for p in pictures))
    prompt, urls = images.placeholders(md)
    ids = images.processor.tokenizer(prompt)["input_ids"]
    got = images.process(urls)
    ids, placed = images.expand(ids, got)
    assert ids == llava_next_processed(folder, text, pictures)["input_ids"][0].tolist()
    req = request(rid, ids, max_new)
    if placed:
        req.images, req.pixel_values = placed, np.concatenate([p.ravel() for p in got.pixels])
    return req


def expected(llava_next, text: str, pictures: list[bytes], max_new=MAX_NEW) -> list[int]:
    return llava_next_reference_generate(llava_next[0], text, pictures, max_new)


def runner(llava_next, num_blocks=96) -> ModelRunner:
    return ModelRunner(str(llava_next[0]), num_blocks=num_blocks, block_size=4)


PROMPTS = [
    ("Look at <image> and say", [image(1)]),
    ("The <image> picture shows", [image(2, TALL)]),
    ("Two: <image> then <image> end", [image(3, SQUARE), image(4, TALL)]),
    ("Just a text prompt about the sea and the sky", []),
    ("<image>", [image(5, SQUARE)]),
    ("Another plain text row, longer than the others by a few words here", []),
    ("Compare <image> now", [image(1)]),
    ("Story of the <image>", [image(6, TALL)]),
]


def test_placeholders_follow_the_size_and_the_encoder_packs_each_image_by_its_own(llava_next):
    req = vision_request(llava_next, "s", "<image> <image> <image>", [image(1), image(2, SQUARE), image(3, TALL)])
    sizes = llava_next_processed(llava_next[0], "<image>", [image(1)])["image_sizes"].tolist()
    assert [im.image_size for im in req.images] == [sizes[0], [30, 30], [40, 24]]  # (height, width)
    assert [im.tokens for im in req.images] == [70, 88, 46]
    assert [im.shape[0] for im in req.images] == [5, 5, 3]  # the base view and the grid's tiles
    # the size is part of the image's content hash: the same views from another size unpad to other rows
    views = req.pixel_values[: req.images[0].size].reshape(req.images[0].shape)
    assert req.images[0].digest == digest(views, [30, 40]) != digest(views, [40, 30]) != digest(views)
    # the 40x30 and 30x30 pictures have the same views' shape: one batch, each packed by its own size
    model, _ = load_llava_next(str(llava_next[0]))
    r = runner(llava_next)
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
    r = runner(llava_next)
    outputs = {}
    for seed in (1, 2):
        engine = Engine.build(r, llava_next[0])
        engine.add(vision_request(llava_next, f"a{seed}", "Look at <image> and say", [image(seed)]))
        outputs[seed] = engine.run()[f"a{seed}"].tokens
        assert outputs[seed] == expected(llava_next, "Look at <image> and say", [image(seed)]), seed
    assert outputs[1] != outputs[2]  # the image, not only the text, decides the answer
    assert r.vision.encoder.images == 2 and not r.vision.cache.outputs  # once per image, dropped after its prefill
    assert r.walk is not None  # the language model runs the same decoder walk as a text model


def test_concurrent_mixed_chunked(llava_next):
    r = runner(llava_next, num_blocks=160)
    # prefills chunked at 24 tokens: an image's placeholders fall across chunk boundaries
    engine = Engine.build(r, llava_next[0], max_batch_prefill_tokens=24)
    for i, (text, pictures) in enumerate(PROMPTS):
        engine.add(vision_request(llava_next, f"r{i}", text, pictures))
    out = engine.run()
    assert engine.batcher.counters["chunked_prefills"] > 0
    for i, (text, pictures) in enumerate(PROMPTS):
        assert out[f"r{i}"].tokens == expected(llava_next, text, pictures), i
    assert r.vision.encoder.images <= sum(len(p) for _, p in PROMPTS)  # the same picture twice: encoded once
    assert not r.vision.cache.pending and not r.vision.cache.outputs


def test_after_preemption(llava_next):
    r = runner(llava_next, num_blocks=64)  # 256 slots: the later rows push the newest out, which recomputes
    engine = Engine.build(r, llava_next[0])
    for i, (text, pictures) in enumerate(PROMPTS[:5]):
        engine.add(vision_request(llava_next, f"p{i}", text, pictures, max_new=16))
    out = engine.run()
    assert engine.batcher.counters["preemptions"] > 0
    for i, (text, pictures) in enumerate(PROMPTS[:5]):
        assert out[f"p{i}"].tokens == expected(llava_next, text, pictures, 16), i


def test_prefix_hit_on_the_same_image_only(llava_next):
    r = runner(llava_next)
    engine = Engine.build(r, llava_next[0])
    text = "Look closely at this <image> and then tell me what it is"
    engine.add(vision_request(llava_next, "first", text, [image(7)]))
    engine.run()
    encoded, c = r.vision.encoder.images, engine.batcher.counters
    same = vision_request(llava_next, "same", text, [image(7)])
    engine.add(same)
    out = engine.run()
    hit = c["prefix_hit_tokens"]
    image_end = same.images[0].start + same.images[0].tokens
    assert hit == (len(same.input_ids) - 1) // 4 * 4 and hit > image_end  # the image lies in the cached prefix
    assert r.vision.encoder.images == encoded  # its blocks were cached: the image was not encoded again
    assert out["same"].tokens == expected(llava_next, text, [image(7)])
    other = vision_request(llava_next, "other", text, [image(8)])
    engine.add(other)
    out = engine.run()
    # the same placeholders, another image: the blocks before the image hit, none from the one holding its first
    assert c["prefix_hit_tokens"] - hit == other.images[0].start // 4 * 4
    assert r.vision.encoder.images == encoded + 1
    assert out["other"].tokens == expected(llava_next, text, [image(8)])
    assert out["other"].tokens != out["same"].tokens
