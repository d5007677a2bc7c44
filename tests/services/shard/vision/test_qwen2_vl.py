"""Tiny Qwen2-VL and Qwen2.5-VL served by the scheduler's Batcher and the shard's ModelRunner (the in-process engine,
plans and results encoded as on the bus): M-RoPE positions as transformers' get_rope_index places them, and greedy
output token-identical to transformers' generate() on the processor's inputs: alone (decoder walk and transformers'
forward), batched with text-only rows and chunked through the images, after preemption, and from a prefix-cache hit
that covers the image (its place known, its pixels never encoded again) (scenarios.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.engine import Engine
from services.shard.vision.mrope import MRopePositions
from tests.services.shard.vision import scenarios
from tests.vision_models import QWEN_FAMILIES, build_qwen_vl, image, load, processed

WIDE, TALL = (40, 30), (24, 40)  # 4x5 and 5x3 image tokens: height and width differ, both ways


@pytest.fixture(scope="module", params=QWEN_FAMILIES)
def qwen(request, tmp_path_factory):
    return scenarios.Family(
        build_qwen_vl(tmp_path_factory.mktemp(request.param), request.param), scenarios.prompts(TALL)
    )


def test_positions_are_get_rope_index(qwen):
    """Every prompt token's three positions, fed in chunks of 7, and the generated tokens' (rope_deltas)."""
    text, pictures = "A <image> and <image> then text", [image(3), image(4, TALL)]
    req = qwen.request("p", text, pictures)
    model, _ = load(str(qwen.folder))
    inputs = processed(qwen.folder, text, pictures)
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
    r = qwen.runner(decoder_walk=walk)
    scenarios.alone(qwen, r, walk=walk)
    assert set(r.vision.mrope.layouts) <= set(r.seqs)  # a finished sequence's layout goes with it


def test_concurrent_mixed_chunked(qwen):
    r = qwen.runner(96)
    scenarios.mixed(qwen, r, chunk=16)  # an image's placeholders fall across chunk boundaries
    assert set(r.vision.mrope.layouts) <= set(r.seqs)


def test_after_preemption(qwen):
    scenarios.after_preemption(qwen, num_blocks=24)  # 96 slots


def test_prefix_hit_on_the_same_image_only(qwen):
    scenarios.prefix_hit_on_the_same_image_only(qwen)  # only the image's place is sent, for the positions


def test_a_text_only_step_keeps_one_position_per_token(qwen):
    """Rows without images (and decode rows past an image) keep [T] positions; only image tokens take [3, T]."""
    r = qwen.runner()
    seen = []
    forward = r.forward_packed
    r.forward_packed = lambda ids, pos, *a, **k: seen.append(pos.dim()) or forward(ids, pos, *a, **k)
    engine = Engine.build(r, qwen.folder)
    engine.add(qwen.request("t", "Just a text prompt", []))
    engine.run()
    assert seen and set(seen) == {1}
    seen.clear()
    engine.add(qwen.request("i", "Look at <image> and say", [image(1)]))
    engine.run()
    assert seen[0] == 2 and set(seen[1:]) == {1}  # the prefill with the image, then decodes
