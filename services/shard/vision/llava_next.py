"""LLaVA-Next's vision (anyres): an image arrives as its base view followed by the tiles of the grid resolution
its size selects, [views, 3, H, W] as LlavaNextProcessor makes them, and transformers' get_image_features runs the
CLIP tower and projector over every view, then packs them: the tiles' features unpadded back to the picture's
aspect, an image_newline closing each row, the base view's first. How many rows an image gives thus depends on its
size before preprocessing, which travels as ImageInput.image_size; the tokenizer's processor counts the same rows
as its placeholders."""

from __future__ import annotations

import torch

from libs.protocol.messages import ImageInput
from services.shard.vision.encoder import VisionEncoder

FAMILIES = {"llava_next"}


class LlavaNextVisionEncoder(VisionEncoder):
    def refuses(self, image: ImageInput) -> str | None:
        if len(image.image_size) != 2:  # a sender older than the field: the rows cannot be counted without it
            return "a LLaVA-Next image needs its (height, width) before preprocessing (image_size); none came with it"
        return None

    def features(self, batch: torch.Tensor, images: list[ImageInput] | None = None) -> list[torch.Tensor]:
        """Each image's packed rows ([tokens, hidden]; images of one view count may still differ in tokens)."""
        sizes = [im.image_size for im in images or ()]
        if len(sizes) != len(batch) or any(len(s) != 2 for s in sizes):
            raise ValueError("a LLaVA-Next image needs its (height, width) before preprocessing (image_size)")
        return self.model.model.get_image_features(
            pixel_values=batch,
            image_sizes=torch.tensor(sizes, dtype=torch.long, device=batch.device),
            vision_feature_layer=self.feature_layer,
            vision_feature_select_strategy=self.select,
            return_dict=True,
        ).pooler_output
