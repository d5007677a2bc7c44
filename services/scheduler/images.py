"""A vision model's images on their way to the shard: which of a request's images a (re)admitted sequence still has
to feed, with their pixels. An image whose placeholders all lie in the sequence's cached prefix (a prefix-cache hit,
its KV already computed) travels without its pixels, only its place (M-RoPE positions after it depend on it): the
shard never encodes it again. For a model whose image tokens attend to each other both ways (Gemma 3), a prefill
chunk never ends inside an image's block: the shard's attention needs the whole block in the step."""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import ImageInput, TokenizedRequest, image_pixels, pixel_frames


def images_to_feed(req: TokenizedRequest, computed: int) -> tuple[list[ImageInput], list[np.ndarray]]:
    """The request's images that end past `computed` prompt tokens, and each one's flat pixels."""
    images, pixels = [], []
    for im, px in zip(req.images, image_pixels(req.images, req.pixel_values, req.pixel_bytes)):
        if im.start + im.tokens > computed:
            images.append(im)
            pixels.append(px)
    return images, pixels


def images_in_prefix(req: TokenizedRequest, computed: int) -> list[ImageInput]:
    """The request's images whose placeholders all lie in its first `computed` prompt tokens (sent without pixels)."""
    return [im for im in req.images if im.start + im.tokens <= computed]


def plan_pixels(pixels: list[np.ndarray]) -> dict[str, np.ndarray | None]:
    """The StepPlan's pixel frames: the new sequences' images' pixels, in order, each dtype in its own frame."""
    return pixel_frames(pixels)


# families whose image blocks are attended both ways in prefill (services/shard/vision/gemma3.py)
WHOLE_IMAGE_FAMILIES = {"gemma3"}


def keeps_images_whole(config: dict) -> bool:
    """Whether a model (its config.json as a dict) needs each image's block in one prefill chunk."""
    return config.get("model_type") in WHOLE_IMAGE_FAMILIES


def whole_image_chunk(req: TokenizedRequest, start: int, n: int) -> int:
    """`n` prompt tokens from `start`, moved so the chunk does not end inside an image's block: back to the image's
    start, or, when the chunk begins at or inside that image, on to its end (a step may then prefill up to one
    image's tokens past its budget)."""
    end = start + n
    for im in req.images:
        a, b = im.start, im.start + im.tokens
        if a < end < b:
            return a - start if a > start else b - start
    return n
