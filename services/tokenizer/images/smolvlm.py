"""SmolVLM2's processor, its image part: transformers' SmolVLMProcessor cannot be built here (its video part needs
torchvision, its video prompts num2words), so the folder's image processor (its PIL path) and tokenizer are loaded
alone and each image token is expanded by transformers' own `get_image_prompt_string`, the function
SmolVLMProcessor expands images with: rows x columns framed tiles and the global image (images/idefics3.py).

Called as ImageProcessor calls a transformers processor (processor.py): one image token and one image in, its
tokens, pixels ([1, tiles, 3, H, W]) and pixel attention mask out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from libs.runtime import model_store

FAMILIES = ("smolvlm",)


class SmolVLMImageProcessor:
    def __init__(self, model_path: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        tok = self.tokenizer
        # the token names SmolVLMProcessor takes from its tokenizer, with its defaults
        self.image_token: str = getattr(tok, "image_token", None) or "<image>"
        self.image_token_id: int = tok.convert_tokens_to_ids(self.image_token)
        self.fake_image_token: str = getattr(tok, "fake_image_token", None) or "<fake_token_around_image>"
        self.global_image_token: str = getattr(tok, "global_image_token", None) or "<global-img>"
        self.image_seq_len = image_seq_len(model_path)

    def __call__(
        self, *, text: str, images: list, add_special_tokens: bool = False, return_tensors: str = "np", **image_kwargs
    ):
        """`text`'s image tokens each expanded for its image, in order, and tokenized; the images' tiles
        (`image_kwargs` go to the image processor: do_rescale, do_normalize)."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        got = self.image_processor(images=[images], return_row_col_info=True, return_tensors="np", **image_kwargs)
        parts = text.split(self.image_token)
        if len(parts) != len(images) + 1:
            raise ValueError(f"{len(parts) - 1} image tokens for {len(images)} images")
        expanded = parts[0]
        for rows, cols, rest in zip(got["rows"][0], got["cols"][0], parts[1:]):
            expanded += (
                get_image_prompt_string(
                    rows,
                    cols,
                    self.image_seq_len,
                    fake_token_around_image=self.fake_image_token,
                    image_token=self.image_token,
                    global_image_token=self.global_image_token,
                )
                + rest
            )
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        out = {"input_ids": np.asarray([ids], np.int64), "pixel_values": np.asarray(got["pixel_values"])}
        if "pixel_attention_mask" in got:
            out["pixel_attention_mask"] = np.asarray(got["pixel_attention_mask"])
        return out


def image_seq_len(model_path: str) -> int:
    """The placeholders per tile: the folder's processor config's `image_seq_len`, else what the model makes of a
    tile ((image_size / patch_size)² / scale_factor², as SmolVLMProcessor documents it)."""
    folder = Path(model_path)
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.exists():
            seq = json.loads(path.read_text()).get("image_seq_len")
            if seq:
                return int(seq)
    config = model_store.read_config(model_path)
    vision = config["vision_config"]
    return int((vision["image_size"] // vision["patch_size"]) ** 2 / config.get("scale_factor", 2) ** 2)
