"""Qwen2-VL's and Qwen2.5-VL's processor, its image part: transformers' Qwen2VLProcessor cannot be built without
torchvision (its video part), so the folder's image processor (its PIL path) and tokenizer are loaded alone and the
image token is expanded here as Qwen2VLProcessor expands it: one `<|image_pad|>` per merged patch
(image_grid_thw's product / merge_size²). As TGI does for Qwen2-VL, an image's tokens are framed by
`<|vision_start|>` and `<|vision_end|>`, which the model's chat template puts around an image.

Called as ImageProcessor calls a transformers processor (processor.py): one image token and one image in, its
tokens and pixels out. The pixels keep the processor's rows in its order, shaped [t, h / m, w / m, m, m, patch
values] so that the grid they came from travels with them (services/shard/vision/qwen2_vl.py reads it back).
Called without rescale and normalize (processor.py's BYTES_FAMILIES), the rows are the resized image's uint8 values
and each row's temporal copies (an image is one frame, repeated temporal_patch_size times) are sent once: shaped
[1, h / m, w / m, m, m, channels, patch, patch], a 1 / (4 x temporal_patch_size) of the float32 rows' bytes, which
the shard finishes and repeats as the processor does (services/shard/vision/pixels.py).
"""

from __future__ import annotations

import numpy as np

from services.tokenizer.images.decode import ImageError

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


class QwenImageProcessor:
    def __init__(self, model_path: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.image_token: str = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge = int(self.image_processor.merge_size)
        self.temporal = int(self.image_processor.temporal_patch_size)
        self.patch = int(self.image_processor.patch_size)

    def __call__(
        self, *, text: str, images: list, add_special_tokens: bool = False, return_tensors: str = "np", **image_kwargs
    ):
        """`text`'s image tokens each expanded (framed) for its image, in order, and tokenized; each image's pixels
        (`pixel_values`, one array per image) and grid (`image_grid_thw`). `image_kwargs` go to the image processor
        (do_rescale, do_normalize: both False gives uint8 rows, one temporal copy each)."""
        raw = image_kwargs.get("do_rescale") is False and image_kwargs.get("do_normalize") is False
        try:
            got = self.image_processor(images=images, return_tensors="np", **image_kwargs)
        except ValueError as e:  # a shape its resizing refuses (an aspect ratio over 200)
            raise ImageError(f"the image cannot be processed for this model: {e}") from None
        grids = np.asarray(got["image_grid_thw"], np.int64)
        parts = text.split(self.image_token)
        if len(parts) != len(images) + 1:
            raise ValueError(f"{len(parts) - 1} image tokens for {len(images)} images")
        m = self.merge
        expanded, pixels, at = parts[0], [], 0
        for (t, h, w), rest in zip(grids.tolist(), parts[1:]):
            expanded += VISION_START + self.image_token * (t * h * w // (m * m)) + VISION_END + rest
            rows = got["pixel_values"][at : at + t * h * w]
            if raw:
                pixels.append(self._bytes(rows).reshape(t, h // m, w // m, m, m, -1, self.patch, self.patch))
            else:
                pixels.append(rows.reshape(t, h // m, w // m, m, m, rows.shape[-1]))
            at += t * h * w
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": np.asarray([ids], np.int64), "pixel_values": pixels, "image_grid_thw": grids}

    def _bytes(self, rows: np.ndarray) -> np.ndarray:
        """uint8 rows [n, channels, patch, patch] from unscaled float32 ones (the resized image's exact values), the
        first of each row's temporal copies."""
        n, width = rows.shape
        channels = width // (self.temporal * self.patch * self.patch)
        first = rows.reshape(n, channels, self.temporal, -1)[:, :, 0]  # a row: (channels, temporal, patch, patch)
        if not np.array_equal(first, np.rint(first)) or first.min(initial=0) < 0 or first.max(initial=0) > 255:
            raise ImageError("the image processor gave rows that are not bytes before rescale")
        return first.astype(np.uint8).reshape(n, channels, self.patch, self.patch)
