"""Idefics3's and SmolVLM's images as tiles: their processor cuts an image into rows x columns tiles plus the whole
image scaled down (the global image), each encoded alone, and writes each tile's placeholders as a run of its own,
framed by `<fake_token_around_image>` and the tile's `<row_i_col_j>` (or `<global-img>`) marker, rows ended by a
newline. So an image becomes one ImageInput per tile: its run of placeholders and its [3, H, W] pixels, which the
shard encodes as transformers' get_image_features encodes that tile (services/shard/vision/idefics3.py).

One image per processor call gives tiles of one size, so the pixel attention mask is all ones (transformers then
computes the same all-ones mask itself); a tile with padding is refused rather than encoded without its mask."""

from __future__ import annotations

import numpy as np

from services.tokenizer.images.decode import ImageError

FAMILIES = ("idefics3", "smolvlm")


def check_mask(got: dict) -> None:
    """Refuse an image whose tiles the processor padded (`got`: its output for one image)."""
    mask = got.get("pixel_attention_mask")
    if mask is not None and not np.asarray(mask).all():
        raise ImageError("the processor padded an image's tiles; padded tiles are not served")


def tiles(tokens: np.ndarray, placeholder_id: int, pixels: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(offset in `tokens`, count, pixels) of each tile of one image, from the processor's `tokens` for it and its
    `pixels` ([tiles, 3, H, W], the tiles in the order of their runs)."""
    marks = np.flatnonzero(tokens == placeholder_id)
    breaks = np.diff(marks) > 1
    starts = marks[np.concatenate(([True], breaks))]
    ends = marks[np.concatenate((breaks, [True]))] + 1
    if len(starts) != len(pixels):
        raise ImageError(f"the processor wrote {len(starts)} placeholder runs for an image of {len(pixels)} tiles")
    return [(int(a), int(b - a), px) for a, b, px in zip(starts, ends, pixels)]
