"""A tiny Gemma 3 vision model served by the scheduler's Batcher and the shard's ModelRunner: greedy output
token-identical to transformers' generate() on its real Gemma3Processor's inputs, alone, 8 mixed with text-only
rows, after preemption and from a prefix hit on the image; an image's tokens attend to each other both ways in
prefill (a causal-only mask gives other tokens)."""

from __future__ import annotations

import base64
import hashlib

import numpy as np
import pytest
from tokenizers import Tokenizer

from bench.engine import Engine, request
from libs.protocol.messages import ImageInput
from services.scheduler.images import whole_image_chunk
from services.shard.model_runner import ModelRunner
from services.shard.vision import loader as vision_loader
from services.tokenizer.images.fetch import FetchLimits
from services.tokenizer.images.processor import ImageLimits, ImageProcessor
from tests.vision_models import build_gemma3, gemma3_processed, gemma3_reference_generate, image

MAX_NEW = 8
IMG = "<start_of_image>"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


def vision_request(model_dir, rid: str, text: str, pictures: list[bytes], max_new=MAX_NEW):
    """The request from the processor's own ids and pixels: each image's block of image tokens placed."""
    inputs = gemma3_processed(model_dir, text, pictures)
    ids = inputs["input_ids"][0].tolist()
    req = request(rid, ids, max_new)
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


def runner(model_dir, num_blocks=64, block_size=4) -> ModelRunner:
    return ModelRunner(str(model_dir), num_blocks=num_blocks, block_size=block_size)


PROMPTS = [
    (f"Look at {IMG} and say", [1]),
    (f"The {IMG} picture shows", [2]),
    (f"Two: {IMG} then {IMG} end", [3, 4]),
    ("Just a text prompt about the sea and the sky", []),
    (IMG, [5]),
    ("Another plain text row, longer than the others by a few words here", []),
    (f"Compare {IMG} now", [1]),
    (f"Story of the {IMG}", [6]),
]


def test_alone_equals_transformers_and_the_image_matters(gemma3):
    r = runner(gemma3)
    outputs = {}
    for k, seed in enumerate((1, 2)):
        engine = Engine.build(r, gemma3)
        engine.add(vision_request(gemma3, f"a{k}", PROMPTS[0][0], [image(seed)]))
        outputs[seed] = engine.run()[f"a{k}"].tokens
        assert outputs[seed] == gemma3_reference_generate(gemma3, PROMPTS[0][0], [image(seed)], MAX_NEW)
    assert outputs[1] != outputs[2]
    assert r.vision.encoder.images == 2 and r.walk is not None


def test_a_causal_only_mask_gives_other_tokens(gemma3, monkeypatch):
    monkeypatch.setattr(vision_loader, "attends_images_both_ways", lambda model: False)
    r = runner(gemma3)
    engine = Engine.build(r, gemma3)
    for i, (text, seeds) in enumerate(PROMPTS):
        engine.add(vision_request(gemma3, f"c{i}", text, [image(s) for s in seeds]))
    out = engine.run()
    wrong = [
        i
        for i, (text, seeds) in enumerate(PROMPTS)
        if seeds and out[f"c{i}"].tokens != gemma3_reference_generate(gemma3, text, [image(s) for s in seeds], MAX_NEW)
    ]
    assert wrong  # the bidirectional image block decides tokens here


def test_concurrent_mixed(gemma3):
    r = runner(gemma3)
    engine = Engine.build(r, gemma3)
    for i, (text, seeds) in enumerate(PROMPTS):
        engine.add(vision_request(gemma3, f"r{i}", text, [image(s) for s in seeds]))
    out = engine.run()
    for i, (text, seeds) in enumerate(PROMPTS):
        assert out[f"r{i}"].tokens == gemma3_reference_generate(gemma3, text, [image(s) for s in seeds], MAX_NEW), i
    assert not r.vision.cache.pending and not r.vision.cache.outputs


def test_concurrent_chunked_keeps_each_image_whole(gemma3):
    r = runner(gemma3)
    # prefills chunked at 10 tokens: a chunk that would end inside an image's block stops before it or takes it whole
    engine = Engine.build(r, gemma3, max_batch_prefill_tokens=10, whole_images=True)
    for i, (text, seeds) in enumerate(PROMPTS):
        engine.add(vision_request(gemma3, f"k{i}", text, [image(s) for s in seeds]))
    out = engine.run()
    assert engine.batcher.counters["chunked_prefills"] > 0
    for i, (text, seeds) in enumerate(PROMPTS):
        assert out[f"k{i}"].tokens == gemma3_reference_generate(gemma3, text, [image(s) for s in seeds], MAX_NEW), i


def test_a_window_narrower_than_an_image_cuts_its_block(tmp_path):
    model_dir = build_gemma3(tmp_path, sliding_window=3)  # 4-token images: the sliding layers see 3 of them
    engine = Engine.build(runner(model_dir), model_dir, max_batch_prefill_tokens=10, whole_images=True)
    for i, (text, seeds) in enumerate(PROMPTS):
        engine.add(vision_request(model_dir, f"w{i}", text, [image(s) for s in seeds]))
    out = engine.run()
    for i, (text, seeds) in enumerate(PROMPTS):
        assert out[f"w{i}"].tokens == gemma3_reference_generate(model_dir, text, [image(s) for s in seeds], MAX_NEW), i


def test_a_chunk_never_ends_inside_an_image():
    req = request("w", list(range(30)), 1)
    req.images = [ImageInput(digest="d", start=8, tokens=4, shape=[1])]
    assert whole_image_chunk(req, 0, 10) == 8  # stops before the image
    assert whole_image_chunk(req, 8, 2) == 4  # begins at it: takes it whole
    assert whole_image_chunk(req, 9, 1) == 3  # begins inside it (a prefix hit): its rest
    assert whole_image_chunk(req, 0, 12) == 12 and whole_image_chunk(req, 0, 5) == 5


def test_after_preemption(gemma3):
    r = runner(gemma3, num_blocks=24)
    engine = Engine.build(r, gemma3)
    for i, (text, seeds) in enumerate(PROMPTS[:5]):
        engine.add(vision_request(gemma3, f"p{i}", text, [image(s) for s in seeds], max_new=16))
    out = engine.run()
    assert engine.batcher.counters["preemptions"] > 0
    for i, (text, seeds) in enumerate(PROMPTS[:5]):
        assert out[f"p{i}"].tokens == gemma3_reference_generate(gemma3, text, [image(s) for s in seeds], 16), i


def test_prefix_hit_on_the_same_image(gemma3):
    r = runner(gemma3)
    engine = Engine.build(r, gemma3)
    text = f"Look closely at this {IMG} and then tell me what it is"
    engine.add(vision_request(gemma3, "first", text, [image(7)]))
    engine.run()
    encoded, c = r.vision.encoder.images, engine.batcher.counters
    same = vision_request(gemma3, "same", text, [image(7)])
    engine.add(same)
    out = engine.run()
    assert c["prefix_hit_tokens"] > same.images[0].start + same.images[0].tokens
    assert r.vision.encoder.images == encoded
    assert out["same"].tokens == gemma3_reference_generate(gemma3, text, [image(7)], MAX_NEW)


def test_the_tokenizer_places_the_soft_tokens_inside_the_frame(gemma3):
    """The tokenizer service's path (markdown image → <start_of_image> → the processor's framed block) gives the
    processor's ids, the image placed on its soft tokens (not the frame), and the reference's answer."""
    images = ImageProcessor(str(gemma3), ImageLimits(fetch=FetchLimits()))
    uri = "data:image/png;base64," + base64.b64encode(image(3)).decode()
    prompt, urls = images.placeholders(f"Look at ![]({uri}) and say")
    ids = Tokenizer.from_file(str(gemma3 / "tokenizer.json")).encode(prompt).ids
    got = images.process(urls)
    ids, placed = images.expand(ids, got)
    want = vision_request(gemma3, "want", PROMPTS[0][0], [image(3)])
    assert ids == list(want.input_ids)
    assert [(p.start, p.tokens) for p in placed] == [(p.start, p.tokens) for p in want.images]
    req = request("tok", ids, MAX_NEW)
    req.images, req.pixel_values = placed, np.concatenate([p.ravel() for p in got.pixels])
    engine = Engine.build(runner(gemma3), gemma3)
    engine.add(req)
    assert engine.run()["tok"].tokens == gemma3_reference_generate(gemma3, PROMPTS[0][0], [image(3)], MAX_NEW)
