"""The vision tower and projector of a vision-language model: an image's pixels in, the embeddings of its
placeholder tokens out, as transformers' own `get_image_features` computes them (same modules, same layer and
feature selection from the config)."""

from __future__ import annotations

import time

import torch

from libs.protocol.messages import ImageInput
from services.shard.vision import qwen2_vl


class VisionEncoder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.feature_layer = getattr(cfg, "vision_feature_layer", -1)
        self.select = getattr(cfg, "vision_feature_select_strategy", "default")
        inner = model.model  # Idefics3 and SmolVLM call their tower vision_model
        tower = inner.vision_tower if hasattr(inner, "vision_tower") else inner.vision_model
        self.dtype = next(tower.parameters()).dtype
        self.device = next(tower.parameters()).device
        self.images = 0  # images encoded (tests and metrics read it)
        self.seconds = 0.0  # time spent encoding them

    @torch.inference_mode()
    def encode(self, pixels: list[torch.Tensor], images: list[ImageInput] | None = None) -> list[torch.Tensor]:
        """Each image's placeholder embeddings, [tokens, hidden]; images of one shape run as one batch. `images`:
        each one's ImageInput, for a family whose features read more than the pixels (LLaVA-Next: its size)."""
        started = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(pixels)
        by_shape: dict[tuple, list[int]] = {}
        for i, px in enumerate(pixels):
            by_shape.setdefault(tuple(px.shape), []).append(i)
        for idx in by_shape.values():
            batch = torch.stack([pixels[i] for i in idx]).to(self.device, self.dtype)
            for i, f in zip(idx, self.features(batch, None if images is None else [images[i] for i in idx])):
                out[i] = f
        self.images += len(pixels)
        self.seconds += time.perf_counter() - started
        return out

    def refuses(self, image: ImageInput) -> str | None:
        """Why this family cannot encode `image` as its message came (None: it can); the shard refuses that request
        alone when it opens it."""
        return None

    def features(self, batch: torch.Tensor, images: list[ImageInput] | None = None) -> torch.Tensor:
        """A batch of same-shaped images' placeholder embeddings, [images, tokens, hidden] (or a list of them)."""
        return self.model.model.get_image_features(
            pixel_values=batch,
            vision_feature_layer=self.feature_layer,
            vision_feature_select_strategy=self.select,
            return_dict=True,
        ).pooler_output


def for_model(model: torch.nn.Module):
    """The vision encoder of the model's family."""
    if model.config.model_type in qwen2_vl.FAMILIES:
        return qwen2_vl.QwenVisionEncoder(model)
    from services.shard.vision import gemma3, idefics3, llava_next  # their encoders subclass this module's

    if model.config.model_type in gemma3.FAMILIES:
        return gemma3.Gemma3VisionEncoder(model)
    if model.config.model_type in llava_next.FAMILIES:
        return llava_next.LlavaNextVisionEncoder(model)
    if model.config.model_type in idefics3.FAMILIES:
        return idefics3.Idefics3VisionEncoder(model)
    return VisionEncoder(model)
