"""Idefics3's and SmolVLM's vision: a SigLIP-like tower over each tile of an image (the tokenizer sends every tile as
an ImageInput of its own, [3, H, W]: services/tokenizer/images/idefics3.py) and the connector's pixel shuffle and
projection, run by transformers' own get_image_features. A tile's embeddings replace its run of placeholders one for
one; the frame and row/column markers between the runs are text tokens. The language model is a Llama, walked as
any text model."""

from __future__ import annotations

import torch

from libs.protocol.messages import ImageInput
from services.shard.vision.encoder import VisionEncoder

FAMILIES = {"idefics3", "smolvlm"}


class Idefics3VisionEncoder(VisionEncoder):
    def features(self, batch: torch.Tensor, images: list[ImageInput] | None = None) -> torch.Tensor:
        """Each tile as an image of its own ([tiles, 1, 3, H, W]): no pixel attention mask, as a tile is never
        padded (transformers computes the same all-ones mask then); no feature layer or select strategy."""
        tiles = self.model.model.get_image_features(pixel_values=batch[:, None], return_dict=True).pooler_output
        return torch.stack(tiles)
