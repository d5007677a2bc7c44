"""A tiny Idefics3 and a tiny SmolVLM2 served by the scheduler's Batcher and the shard's ModelRunner (the in-process
engine, plans and results encoded as on the bus): the tokenizer's expansion of an image into tiles (rows x columns
plus the global image, each a run of placeholders framed by its markers) equals Idefics3Processor's (SmolVLM2: its
image processor and transformers' get_image_prompt_string, as SmolVLMProcessor expands), its tiles' pixels the
processor's, in order, and greedy output is token-identical to transformers' generate() on the processor's inputs:
alone, 8 mixed with text-only rows and chunked inside the tiles, after preemption, and from a prefix-cache hit on the
same image (scenarios.py)."""

from __future__ import annotations

import numpy as np
import pytest

from services.tokenizer.images.decode import ImageError
from services.tokenizer.images.idefics3 import check_mask
from tests.services.shard.vision import scenarios
from tests.vision_models import IDEFICS3_FAMILIES, IDEFICS3_TILE_TOKENS, build_idefics3, image

WIDE, NARROW = (40, 30), (40, 12)  # 2x2 tiles and 1x2 tiles, each with the global image


@pytest.fixture(scope="module", params=IDEFICS3_FAMILIES)
def idefics3(request, tmp_path_factory):
    folder = build_idefics3(tmp_path_factory.mktemp(request.param), family=request.param)
    return scenarios.Family(folder, scenarios.prompts(NARROW), num_blocks=96, same_pixels=True)


def test_an_image_becomes_its_tiles(idefics3):
    req = idefics3.request("t", "Look at <image> and say", [image(1)])
    ids = np.asarray(req.input_ids)
    assert [(im.tokens, im.shape) for im in req.images] == [(IDEFICS3_TILE_TOKENS, [3, 28, 28])] * 5  # 2x2 + global
    assert [im.dtype for im in req.images] == ["uint8"] * 5  # as bytes before rescale and normalize
    assert req.pixel_bytes.nbytes == 5 * 3 * 28 * 28 and req.pixel_values is None
    for im in req.images:  # each run of placeholders is framed: its marker before it, text after it
        assert ids[im.start - 1] != ids[im.start] == ids[im.start + im.tokens - 1] != ids[im.start + im.tokens]
    assert len({im.digest for im in req.images}) == 5
    with pytest.raises(ImageError, match="padded"):
        check_mask({"pixel_attention_mask": np.array([[[1, 1], [1, 0]]])})


def test_alone_equals_transformers_and_the_image_matters(idefics3):
    r = idefics3.runner()
    scenarios.alone(idefics3, r)
    assert r.vision.encoder.images == 10  # 5 tiles an image, each encoded once


def test_concurrent_mixed_chunked(idefics3):
    r = idefics3.runner()
    split, step = [], r.vision.cache.step

    def step_noting_split_tiles(seqs, context_lens, num_tokens, cu):
        for i, seq in enumerate(seqs.tolist()):
            end = int(context_lens[i] + num_tokens[i])
            split.extend(p for p in r.vision.cache.pending.get(seq, ()) if p.image.start < end < p.end)
        return step(seqs, context_lens, num_tokens, cu)

    r.vision.cache.step = step_noting_split_tiles
    scenarios.mixed(idefics3, r, chunk=10)  # chunks end inside tiles' runs and between them
    assert split  # some chunk ended inside a tile's run


def test_after_preemption(idefics3):
    scenarios.after_preemption(idefics3, num_blocks=40)  # 160 slots


def test_prefix_hit_on_the_same_image_only(idefics3):
    scenarios.prefix_hit_on_the_same_image_only(idefics3)  # no tile encoded again; another image: its 5 tiles
