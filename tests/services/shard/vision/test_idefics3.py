"""A tiny Idefics3 and a tiny SmolVLM2 served by the scheduler's Batcher and the shard's ModelRunner (the in-process
engine, plans and results encoded as on the bus): the tokenizer's expansion of an image into tiles (rows x columns
plus the global image, each a run of placeholders framed by its markers) equals Idefics3Processor's (SmolVLM2: its
image processor and transformers' get_image_prompt_string, as SmolVLMProcessor expands), and greedy output is
token-identical to transformers' generate() on the processor's inputs: alone, 8 mixed with text-only rows and chunked
inside the tiles, after preemption, and from a prefix-cache hit on the same image."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from tokenizers import Tokenizer

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner
from services.tokenizer.images.decode import ImageError
from services.tokenizer.images.fetch import FetchLimits
from services.tokenizer.images.idefics3 import check_mask
from services.tokenizer.images.processor import ImageLimits, ImageProcessor
from tests.vision_models import (
    IDEFICS3_FAMILIES,
    IDEFICS3_TILE_TOKENS,
    build_idefics3,
    idefics3_processed,
    idefics3_reference_generate,
    image,
)

MAX_NEW = 8
WIDE, NARROW = (40, 30), (40, 12)  # 2x2 tiles and 1x2 tiles, each with the global image


@pytest.fixture(scope="module", params=IDEFICS3_FAMILIES)
def idefics3(request, tmp_path_factory):
    return build_idefics3(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.fixture(scope="module")
def images(idefics3):
    return ImageProcessor(str(idefics3), ImageLimits(fetch=FetchLimits()))


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def vision_request(idefics3, images: ImageProcessor, rid: str, text: str, pictures: list[bytes], max_new=MAX_NEW):
    """The request as the tokenizer admits it: markdown images → `<image>` → the processor's tiles; its ids and
    pixels must be the processor's own."""
    md = text.replace("<image>", "![]({})").format(*(data_uri(p) for p in pictures))
    prompt, urls = images.placeholders(md)
    ids = Tokenizer.from_file(str(idefics3 / "tokenizer.json")).encode(prompt).ids
    got = images.process(urls)
    ids, placed = images.expand(ids, got)
    want = idefics3_processed(idefics3, text, pictures)
    assert ids == want["input_ids"][0].tolist()
    req = request(rid, ids, max_new)
    if placed:
        req.pixel_values = np.concatenate([p.ravel() for p in got.pixels])
        assert np.array_equal(req.pixel_values, want["pixel_values"].numpy().ravel())  # the tiles, in order
        req.images = placed
    return req


def expected(idefics3, text: str, pictures: list[bytes], max_new=MAX_NEW) -> list[int]:
    return idefics3_reference_generate(idefics3, text, pictures, max_new)


def runner(idefics3, num_blocks=96, block_size=4) -> ModelRunner:
    return ModelRunner(str(idefics3), num_blocks=num_blocks, block_size=block_size)


PROMPTS = [
    ("Look at <image> and say", [image(1)]),
    ("The <image> picture shows", [image(2, NARROW)]),
    ("Two: <image> then <image> end", [image(3), image(4, NARROW)]),
    ("Just a text prompt about the sea and the sky", []),
    ("<image>", [image(5)]),
    ("Another plain text row, longer than the others by a few words here", []),
    ("Compare <image> now", [image(1)]),
    ("Story of the <image>", [image(6, NARROW)]),
]


def test_an_image_becomes_its_tiles(idefics3, images):
    req = vision_request(idefics3, images, "t", "Look at <image> and say", [image(1)])
    ids = np.asarray(req.input_ids)
    assert [(im.tokens, im.shape) for im in req.images] == [(IDEFICS3_TILE_TOKENS, [3, 28, 28])] * 5  # 2x2 + global
    for im in req.images:  # each run of placeholders is framed: its marker before it, text after it
        assert ids[im.start - 1] != ids[im.start] == ids[im.start + im.tokens - 1] != ids[im.start + im.tokens]
    assert len({im.digest for im in req.images}) == 5
    with pytest.raises(ImageError, match="padded"):
        check_mask({"pixel_attention_mask": np.array([[[1, 1], [1, 0]]])})


def test_alone_equals_transformers_and_the_image_matters(idefics3, images):
    r = runner(idefics3)
    outputs = {}
    for k, seed in enumerate((1, 2)):
        engine = Engine.build(r, idefics3)
        engine.add(vision_request(idefics3, images, f"a{k}", PROMPTS[0][0], [image(seed)]))
        outputs[seed] = engine.run()[f"a{k}"].tokens
        assert outputs[seed] == expected(idefics3, PROMPTS[0][0], [image(seed)])
    assert outputs[1] != outputs[2]  # the image, not only the text, decides the answer
    assert r.vision.encoder.images == 10 and not r.vision.cache.outputs  # 5 tiles an image, dropped after prefill
    assert r.walk is not None  # the language model runs the same decoder walk as a text model


def test_concurrent_mixed_chunked(idefics3, images):
    r = runner(idefics3)
    # prefills chunked at 10 tokens: chunks end inside tiles' runs and between them
    engine = Engine.build(r, idefics3, max_batch_prefill_tokens=10)
    split, step = [], r.vision.cache.step

    def step_noting_split_tiles(seqs, context_lens, num_tokens, cu):
        for i, seq in enumerate(seqs.tolist()):
            end = int(context_lens[i] + num_tokens[i])
            split.extend(p for p in r.vision.cache.pending.get(seq, ()) if p.image.start < end < p.end)
        return step(seqs, context_lens, num_tokens, cu)

    r.vision.cache.step = step_noting_split_tiles
    for i, (text, pictures) in enumerate(PROMPTS):
        engine.add(vision_request(idefics3, images, f"r{i}", text, pictures))
    out = engine.run()
    assert engine.batcher.counters["chunked_prefills"] > 0 and split  # some chunk ended inside a tile's run
    for i, (text, pictures) in enumerate(PROMPTS):
        assert out[f"r{i}"].tokens == expected(idefics3, text, pictures), i
    assert not r.vision.cache.pending and not r.vision.cache.outputs


def test_after_preemption(idefics3, images):
    r = runner(idefics3, num_blocks=40)  # 160 slots: the later rows push the newest out, which recomputes
    engine = Engine.build(r, idefics3)
    for i, (text, pictures) in enumerate(PROMPTS[:5]):
        engine.add(vision_request(idefics3, images, f"p{i}", text, pictures, max_new=16))
    out = engine.run()
    assert engine.batcher.counters["preemptions"] > 0
    for i, (text, pictures) in enumerate(PROMPTS[:5]):
        assert out[f"p{i}"].tokens == expected(idefics3, text, pictures, 16), i


def test_prefix_hit_on_the_same_image_only(idefics3, images):
    r = runner(idefics3)
    engine = Engine.build(r, idefics3)
    text = "Look closely at this <image> and then tell me what it is"
    engine.add(vision_request(idefics3, images, "first", text, [image(7)]))
    engine.run()
    encoded, c = r.vision.encoder.images, engine.batcher.counters
    same = vision_request(idefics3, images, "same", text, [image(7)])
    engine.add(same)
    out = engine.run()
    hit = c["prefix_hit_tokens"]
    assert hit == (len(same.input_ids) - 1) // 4 * 4 and hit > same.images[-1].start + IDEFICS3_TILE_TOKENS
    assert r.vision.encoder.images == encoded  # its blocks were cached: no tile was encoded again
    assert out["same"].tokens == expected(idefics3, text, [image(7)])
    other = vision_request(idefics3, images, "other", text, [image(8)])
    engine.add(other)
    out = engine.run()
    # the same placeholders, another image: the blocks before its first tile hit, none from the one holding it
    assert c["prefix_hit_tokens"] - hit == other.images[0].start // 4 * 4
    assert r.vision.encoder.images == encoded + 5
    assert out["other"].tokens == expected(idefics3, text, [image(8)])
    assert out["other"].tokens != out["same"].tokens
