"""A vision model's images on their way to the shard: which of a request's images a (re)admitted sequence still has
to feed, with their pixels. An image whose placeholders all lie in the sequence's cached prefix (a prefix-cache hit,
its KV already computed) travels without its pixels, only its place (M-RoPE positions after it depend on it): the
shard never encodes it again."""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import ImageInput, TokenizedRequest


def images_to_feed(req: TokenizedRequest, computed: int) -> tuple[list[ImageInput], list[np.ndarray]]:
    """The request's images that end past `computed` prompt tokens, and each one's flat pixels."""
    images, pixels, at = [], [], 0
    for im in req.images:
        size = im.size
        if im.start + im.tokens > computed:
            images.append(im)
            pixels.append(req.pixel_values[at : at + size])
        at += size
    return images, pixels


def images_in_prefix(req: TokenizedRequest, computed: int) -> list[ImageInput]:
    """The request's images whose placeholders all lie in its first `computed` prompt tokens (sent without pixels)."""
    return [im for im in req.images if im.start + im.tokens <= computed]


def plan_pixels(pixels: list[np.ndarray]) -> np.ndarray | None:
    """The StepPlan's pixel frame: the new sequences' images' pixels, in order (None: no image this step)."""
    return np.concatenate(pixels).astype(np.float32, copy=False) if pixels else None
