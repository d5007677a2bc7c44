"""Qwen2-VL and Qwen2.5-VL on the shard: their vision transformer (2-D rotary, patch merger; Qwen2.5-VL's window
attention) run by transformers' own `get_image_features` on an image's patches and grid, and their language model
as a causal LM for the runner's walk (transformers has no causal LM class for their text configs).

An image's pixels arrive shaped [t, h / m, w / m, m, m, patch values] (services/tokenizer/images/qwen2_vl.py): the
processor's rows in its own order, with the grid they came from kept in the shape. `token_grid` reads the grid of
the image's tokens (t, h / m, w / m), which M-RoPE places (mrope.py); the encoder reads the patch grid (t, h, w).
"""

from __future__ import annotations

import time

import torch
from transformers.modeling_outputs import CausalLMOutput

from libs.protocol.messages import ImageInput

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def token_grid(image: ImageInput) -> tuple[int, int, int]:
    """(t, h, w) of the image's placeholder tokens: one per merged patch."""
    t, h, w = image.shape[:3]
    return int(t), int(h), int(w)


class QwenVisionEncoder:
    """The vision transformer and merger: an image's patches in, its placeholder embeddings out (VisionEncoder's
    interface)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        visual = model.model.visual
        self.dtype = next(visual.parameters()).dtype
        self.device = next(visual.parameters()).device
        self.images = 0  # images encoded (tests and metrics read it)
        self.seconds = 0.0  # time spent encoding them

    @torch.inference_mode()
    def refuses(self, image: ImageInput) -> str | None:
        """None: what the encoder reads (the pixels and their grid) is in every message (VisionEncoder.refuses)."""
        return None

    def encode(self, pixels: list[torch.Tensor], images: list[ImageInput] | None = None) -> list[torch.Tensor]:
        """Each image's placeholder embeddings, [tokens, hidden]; every image in one call (the tower attends within
        each image only, by its grid)."""
        started = time.perf_counter()
        grids = [(s[0], s[1] * s[3], s[2] * s[4]) for s in (px.shape for px in pixels)]  # patches: (t, h, w)
        flat = torch.cat([px.reshape(-1, px.shape[-1]) for px in pixels]).to(self.device, self.dtype)
        feats = self.model.model.get_image_features(
            pixel_values=flat,
            image_grid_thw=torch.tensor(grids, dtype=torch.long, device=self.device),
            return_dict=True,
        ).pooler_output
        self.images += len(pixels)
        self.seconds += time.perf_counter() - started
        return list(feats)


class _QwenCausalLM(torch.nn.Module):
    """The vision model's language model and LM head as a causal LM (the modules themselves, nothing copied):
    the decoder walk walks it; transformers' forward of it takes [3, 1, T] M-RoPE positions or [1, T] ones."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model.model.language_model
        self.lm_head = model.get_output_embeddings()
        self.config = self.model.config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, logits_to_keep=None, **kwargs):
        h = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, **kwargs)
        h = h.last_hidden_state
        return CausalLMOutput(logits=self.lm_head(h if logits_to_keep is None else h[:, logits_to_keep]))


# one class per family: the decoder walk knows an architecture by its class name (decoder_walk.ARCHS)
class Qwen2VLCausalLM(_QwenCausalLM):
    pass


class Qwen2_5_VLCausalLM(_QwenCausalLM):
    pass


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    return {"qwen2_vl": Qwen2VLCausalLM, "qwen2_5_vl": Qwen2_5_VLCausalLM}[model.config.model_type](model)
