"""Tiny Qwen2-VL and Qwen2.5-VL served by the scheduler's Batcher and the shard's ModelRunner (the in-process engine,
plans and results encoded as on the bus): M-RoPE positions as transformers' get_rope_index places them, and greedy
output token-identical to transformers' generate() on the processor's inputs: alone (decoder walk and transformers'
forward), batched with text-only rows and chunked through the images, after preemption, and from a prefix-cache hit
that covers the image (its place known, its pixels never encoded again)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner
from services.shard.vision.mrope import MRopePositions
from services.tokenizer.images.fetch import FetchLimits
from services.tokenizer.images.processor import ImageLimits, ImageProcessor
from tests.vision_models import (
    QWEN_FAMILIES,
    build_qwen_vl,
    image,
    load_qwen_vl,
    qwen_processed,
    qwen_reference_generate,
)

MAX_NEW = 8
WIDE, TALL = (40, 30), (24, 40)  # 4x5 and 5x3 image tokens: height and width differ, both ways


@pytest.fixture(scope="module", params=QWEN_FAMILIES)
def qwen(request, tmp_path_factory):
    folder = build_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)
    return folder, ImageProcessor(str(folder), ImageLimits(fetch=FetchLimits()))


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def vision_request(qwen, rid: str, text: str, pictures: list[bytes], max_new=MAX_NEW):
    """The request as the tokenizer admits it: markdown images → the image token → its framed placeholders; its
    ids must be the reference processor's own."""
    folder, images = qwen
    md = text.replace("<image>", "![]({})").format(*(data_uri(p) for p in pictures))
    prompt, urls = images.placeholders(md)
    ids = images.processor.tokenizer(prompt)["input_ids"]
    got = images.process(urls)
    ids, placed = images.expand(ids, got)
    assert ids == qwen_processed(folder, text, pictures)["input_ids"][0].tolist()
    req = request(rid, ids, max_new)
    if placed:
        req.images, req.pixel_values = placed, np.concatenate([p.ravel() for p in got.pixels])
    return req


def expected(qwen, text: str, pictures: list[bytes], max_new=MAX_NEW) -> list[int]:
    return qwen_reference_generate(qwen[0], text, pictures, max_new)


PROMPTS = [
    ("Look at <image> and say", [image(1)]),
    ("The <image> picture shows", [image(2, TALL)]),
    ("Two: <image> then <image> end", [image(3), image(4, TALL)]),
    ("Just a text prompt about the sea and the sky", []),
    ("<image>", [image(5)]),
    ("Another plain text row, longer than the others by a few words here", []),
    ("Compare <image> now", [image(1)]),
    ("Story of the <image>", [image(6, TALL)]),
]


def test_positions_are_get_rope_index(qwen):
    """Every prompt token's three positions, fed in chunks of 7, and the generated tokens' (rope_deltas)."""
    text, pictures = "A <image> and <image> then text", [image(3), image(4, TALL)]
    req = vision_request(qwen, "p", text, pictures)
    model, _, _ = load_qwen_vl(str(qwen[0]))
    inputs = qwen_processed(qwen[0], text, pictures)
    want, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    mrope = MRopePositions()
    mrope.open(7, list(reversed(req.images)))  # a cached prefix's images come first, in any order
    n = len(req.input_ids)
    got = []
    for lo in range(0, n + 3, 7):
        hi = min(lo + 7, n + 3)  # past the prompt: generated tokens
        step = mrope.positions(np.array([7]), np.array([0, hi - lo]), np.arange(lo, hi))
        got.append(step if step.ndim == 2 else np.repeat(step[None], 3, axis=0))
    got = np.concatenate(got, axis=1)
    assert got[:, :n].tolist() == want[:, 0].tolist()
    assert got[:, n:].tolist() == [list(range(n + int(delta), n + int(delta) + 3))] * 3
    assert int(delta) < 0  # the images moved the text after them


@pytest.mark.parametrize("walk", [True, False])
def test_alone_equals_transformers_and_the_image_matters(qwen, walk):
    r = ModelRunner(str(qwen[0]), num_blocks=64, block_size=4, decoder_walk=walk)
    assert (r.walk is not None) == walk  # the language model runs the decoder walk as a text model does
    outputs = {}
    for seed in (1, 2):
        engine = Engine.build(r, qwen[0])
        engine.add(vision_request(qwen, f"a{seed}", "Look at <image> and say", [image(seed)]))
        outputs[seed] = engine.run()[f"a{seed}"].tokens
        assert outputs[seed] == expected(qwen, "Look at <image> and say", [image(seed)]), seed
    assert outputs[1] != outputs[2]  # the image, not only the text, decides the answer
    assert r.vision.encoder.images == 2 and not r.vision.cache.outputs  # once per image, dropped after its prefill
    assert set(r.vision.mrope.layouts) <= set(r.seqs)  # a finished sequence's layout goes with it


def test_concurrent_mixed_chunked(qwen):
    r = ModelRunner(str(qwen[0]), num_blocks=96, block_size=4)
    # prefills chunked at 16 tokens: an image's placeholders fall across chunk boundaries
    engine = Engine.build(r, qwen[0], max_batch_prefill_tokens=16)
    for i, (text, pictures) in enumerate(PROMPTS):
        engine.add(vision_request(qwen, f"r{i}", text, pictures))
    out = engine.run()
    assert engine.batcher.counters["chunked_prefills"] > 0
    for i, (text, pictures) in enumerate(PROMPTS):
        assert out[f"r{i}"].tokens == expected(qwen, text, pictures), i
    assert r.vision.encoder.images <= sum(len(p) for _, p in PROMPTS)  # the same picture twice: encoded once
    assert not r.vision.cache.pending and not r.vision.cache.outputs and set(r.vision.mrope.layouts) <= set(r.seqs)


def test_after_preemption(qwen):
    r = ModelRunner(str(qwen[0]), num_blocks=24, block_size=4)  # 96 slots: the later rows push the newest out
    engine = Engine.build(r, qwen[0])
    for i, (text, pictures) in enumerate(PROMPTS[:5]):
        engine.add(vision_request(qwen, f"p{i}", text, pictures, max_new=16))
    out = engine.run()
    assert engine.batcher.counters["preemptions"] > 0
    for i, (text, pictures) in enumerate(PROMPTS[:5]):
        assert out[f"p{i}"].tokens == expected(qwen, text, pictures, 16), i


def test_prefix_hit_on_the_same_image_only(qwen):
    r = ModelRunner(str(qwen[0]), num_blocks=64, block_size=4)
    engine = Engine.build(r, qwen[0])
    text = "Look closely at this <image> and then tell me what it is"
    engine.add(vision_request(qwen, "first", text, [image(7)]))
    engine.run()
    encoded, c = r.vision.encoder.images, engine.batcher.counters
    same = vision_request(qwen, "same", text, [image(7)])
    engine.add(same)
    out = engine.run()
    hit = c["prefix_hit_tokens"]
    image_end = same.images[0].start + same.images[0].tokens
    assert hit == (len(same.input_ids) - 1) // 4 * 4 and hit > image_end  # the image lies in the cached prefix
    assert r.vision.encoder.images == encoded  # not encoded again: only its place was sent, for the positions
    assert out["same"].tokens == expected(qwen, text, [image(7)])
    other = vision_request(qwen, "other", text, [image(8)])
    engine.add(other)
    out = engine.run()
    # the same placeholders, another image: the blocks before the image hit, none from the one holding its first
    assert c["prefix_hit_tokens"] - hit == other.images[0].start // 4 * 4
    assert r.vision.encoder.images == encoded + 1
    assert out["other"].tokens == expected(qwen, text, [image(8)])
    assert out["other"].tokens != out["same"].tokens


def test_a_text_only_step_keeps_one_position_per_token(qwen):
    """Rows without images (and decode rows past an image) keep [T] positions; only image tokens take [3, T]."""
    r = ModelRunner(str(qwen[0]), num_blocks=64, block_size=4)
    seen = []
    forward = r.forward_packed
    r.forward_packed = lambda ids, pos, *a, **k: seen.append(pos.dim()) or forward(ids, pos, *a, **k)
    engine = Engine.build(r, qwen[0])
    engine.add(vision_request(qwen, "t", "Just a text prompt", []))
    engine.run()
    assert seen and set(seen) == {1}
    seen.clear()
    engine.add(vision_request(qwen, "i", "Look at <image> and say", [image(1)]))
    engine.run()
    assert seen[0] == 2 and set(seen[1:]) == {1}  # the prefill with the image, then decodes
