"""A tiny LLaVA served by the scheduler's Batcher and the shard's ModelRunner (the in-process engine, plans and
results encoded as on the bus): greedy output token-identical to transformers' generate() on the processor's
inputs, alone, batched with text-only rows and chunked, after preemption, and from a prefix-cache hit on the image;
the vision tower runs once per image and its output is dropped when the prefill no longer needs it."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from tokenizers import Tokenizer

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner
from services.tokenizer.images.fetch import FetchLimits
from services.tokenizer.images.processor import ImageLimits, ImageProcessor
from tests.vision_models import IMAGE_TOKENS, build_llava, image, processed, reference_generate

MAX_NEW = 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def images(llava):
    return ImageProcessor(str(llava), ImageLimits(fetch=FetchLimits()))


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def vision_request(llava, images: ImageProcessor, rid: str, text: str, pictures: list[bytes], max_new=MAX_NEW):
    """The request as the tokenizer admits it: markdown images → the model's image token → the processor's
    placeholder tokens; its ids must be the processor's own."""
    md = text.replace("<image>", "![]({})").format(*(data_uri(p) for p in pictures))
    prompt, urls = images.placeholders(md)
    ids = Tokenizer.from_file(str(llava / "tokenizer.json")).encode(prompt).ids
    got = images.process(urls)
    ids, placed = images.expand(ids, got)
    assert ids == processed(llava, text, pictures)[0]
    req = request(rid, ids, max_new)
    if placed:
        req.images, req.pixel_values = placed, np.concatenate([p.ravel() for p in got.pixels])
    return req


def runner(llava, num_blocks=64, block_size=4) -> ModelRunner:
    return ModelRunner(str(llava), num_blocks=num_blocks, block_size=block_size)


PROMPTS = [
    ("Look at <image> and say", [1]),
    ("The <image> picture shows", [2]),
    ("Two: <image> then <image> end", [3, 4]),
    ("Just a text prompt about the sea and the sky", []),
    ("<image>", [5]),
    ("Another plain text row, longer than the others by a few words here", []),
    ("Compare <image> now", [1]),
    ("Story of the <image>", [6]),
]


def test_alone_equals_transformers_and_the_image_matters(llava, images):
    r = runner(llava)
    outputs = {}
    for k, seed in enumerate((1, 2)):
        engine = Engine.build(r, llava)
        engine.add(vision_request(llava, images, f"a{k}", "Look at <image> and say", [image(seed)]))
        outputs[seed] = engine.run()[f"a{k}"].tokens
        assert outputs[seed] == reference_generate(llava, "Look at <image> and say", [image(seed)], MAX_NEW)
    assert outputs[1] != outputs[2]  # the image, not only the text, decides the answer
    assert r.vision.encoder.images == 2 and not r.vision.cache.outputs  # once per image, dropped after its prefill
    assert r.walk is not None  # the language model runs the same decoder walk as a text model


def test_concurrent_mixed_chunked(llava, images):
    r = runner(llava)
    # prefills chunked at 24 tokens: an image's 16 placeholders fall across chunk boundaries
    engine = Engine.build(r, llava, max_batch_prefill_tokens=24)
    for i, (text, seeds) in enumerate(PROMPTS):
        engine.add(vision_request(llava, images, f"r{i}", text, [image(s) for s in seeds]))
    out = engine.run()
    assert engine.batcher.counters["chunked_prefills"] > 0
    for i, (text, seeds) in enumerate(PROMPTS):
        assert out[f"r{i}"].tokens == reference_generate(llava, text, [image(s) for s in seeds], MAX_NEW), i
    assert r.vision.encoder.images <= sum(len(s) for _, s in PROMPTS)  # the same picture twice: encoded once
    assert not r.vision.cache.pending and not r.vision.cache.outputs


def test_after_preemption(llava, images):
    r = runner(llava, num_blocks=24)  # 96 slots: the later rows push the newest out, which recomputes
    engine = Engine.build(r, llava)
    for i, (text, seeds) in enumerate(PROMPTS[:5]):
        engine.add(vision_request(llava, images, f"p{i}", text, [image(s) for s in seeds], max_new=16))
    out = engine.run()
    assert engine.batcher.counters["preemptions"] > 0
    for i, (text, seeds) in enumerate(PROMPTS[:5]):
        assert out[f"p{i}"].tokens == reference_generate(llava, text, [image(s) for s in seeds], 16), i


def test_prefix_hit_on_the_same_image_only(llava, images):
    r = runner(llava)
    engine = Engine.build(r, llava)
    text = "Look closely at this <image> and then tell me what it is"
    engine.add(vision_request(llava, images, "first", text, [image(7)]))
    engine.run()
    encoded, c = r.vision.encoder.images, engine.batcher.counters
    same = vision_request(llava, images, "same", text, [image(7)])
    engine.add(same)
    out = engine.run()
    hit = c["prefix_hit_tokens"]
    assert hit == (len(same.input_ids) - 1) // 4 * 4 and hit > same.images[0].start + IMAGE_TOKENS  # all of it
    assert r.vision.encoder.images == encoded  # its blocks were cached: the image was not encoded again
    assert out["same"].tokens == reference_generate(llava, text, [image(7)], MAX_NEW)
    other = vision_request(llava, images, "other", text, [image(8)])
    engine.add(other)
    out = engine.run()
    # the same placeholders, another image: the blocks before the image hit, none from the one holding its first
    assert c["prefix_hit_tokens"] - hit == other.images[0].start // 4 * 4
    assert r.vision.encoder.images == encoded + 1
    assert out["other"].tokens == reference_generate(llava, text, [image(8)], MAX_NEW)
    assert out["other"].tokens != out["same"].tokens
