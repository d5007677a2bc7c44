"""The encoder cache: an image is encoded when its placeholders are first fed, kept between the chunks of its
prefill and dropped after; past `max_images` the least recently used goes and is encoded again from its pixels,
to the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.protocol.messages import ImageInput
from services.shard.vision import loader
from services.shard.vision.cache import EncoderCache
from services.shard.vision.encoder import VisionEncoder
from services.tokenizer.images.processor import digest
from tests.vision_models import IMAGE_SIZE, IMAGE_TOKENS, build_llava


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    model = loader.from_pretrained(
        str(build_llava(tmp_path_factory.mktemp("llava"))), attn="eager", dtype=torch.float32
    )
    return VisionEncoder(model.eval())


def picture(seed: int, start: int) -> tuple[ImageInput, np.ndarray]:
    pixels = np.random.default_rng(seed).standard_normal((3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    return ImageInput(digest=digest(pixels), start=start, tokens=IMAGE_TOKENS, shape=list(pixels.shape)), pixels


def step(cache: EncoderCache, rows: list[tuple[int, int, int]]):
    """rows: (seq, context length, tokens fed)."""
    seqs, ctx, n = (np.asarray(col, np.int64) for col in zip(*rows))
    cu = np.concatenate([[0], np.cumsum(n)])
    return cache.step(seqs, ctx, n, cu)


def test_kept_between_chunks_then_dropped(encoder):
    cache = EncoderCache(encoder)
    (a, pa), (b, pb) = picture(1, 2), picture(2, 2 + IMAGE_TOKENS)
    cache.open(7, [a, b], [pa.ravel(), pb.ravel()])
    got = step(cache, [(7, 0, 24)])  # all of a, the first 6 of b's placeholders
    assert encoder.images == 2 and list(cache.outputs) == [b.digest]  # a is fed: dropped; b waits for its rest
    assert got.positions.tolist() == list(range(2, 24))
    whole = encoder.encode([torch.from_numpy(pb)])[0]
    rest = step(cache, [(7, 24, 40)])
    assert torch.allclose(
        rest.rows, whole[6:], atol=1e-5
    )  # (encoded in another batch) and not cache.outputs and not cache.pending


def test_past_the_bound_the_oldest_is_encoded_again(encoder):
    cache = EncoderCache(encoder, max_images=1)
    (a, pa), (b, pb) = picture(3, 0), picture(4, 0)
    cache.open(1, [a], [pa.ravel()])
    cache.open(2, [b], [pb.ravel()])
    before = encoder.images
    first = step(cache, [(1, 0, 4), (2, 0, 4)])  # both half-fed: only one output may stay
    assert len(cache.outputs) == 1 and encoder.images == before + 2
    later = step(cache, [(1, 4, IMAGE_TOKENS - 4), (2, 4, IMAGE_TOKENS - 4)])
    assert encoder.images == before + 3  # the evicted one, from its pixels again
    full = {d: o for d, o in zip((a.digest, b.digest), encoder.encode([torch.from_numpy(pa), torch.from_numpy(pb)]))}
    assert torch.equal(first.rows[:4], full[a.digest][:4]) and torch.equal(
        later.rows[: IMAGE_TOKENS - 4], full[a.digest][4:]
    )
    assert not cache.outputs and not cache.pending
    cache.open(3, [a], [pa.ravel()])
    cache.drop(3)  # a finished or preempted sequence leaves nothing behind
    assert not cache.pending
