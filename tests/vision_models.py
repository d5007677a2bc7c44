"""A tiny random-weight LLaVA 1.5 built locally (no Hub): a CLIP vision tower, the two-layer projector and a Llama
language model, with a real processor (transformers' LlavaProcessor over CLIP's PIL image processor and the tiny
byte-level tokenizer with an `<image>` token added), and transformers' own greedy generate() on the processor's
inputs as the reference."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import BOS, EMBED_STD, EOS, PAD, WEIGHT_STD, build_tokenizer

IMAGE_SIZE, PATCH = 28, 7  # 16 patches: 16 placeholder tokens per image (CLS dropped, "default" selection)
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def build_llava(out_dir: str | Path, seed: int = 0) -> Path:
    """Build (once) the tiny LLaVA into `out_dir`; returns the folder."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "processor_config.json").exists():
        return out
    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.token_to_id("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peaked logits, as the tiny text models (tests/tiny_models.py); the image steers them
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * EMBED_STD)
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=PreTrainedTokenizerFast.from_pretrained(out),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)
    return out


def image(seed: int, size=(40, 30), fmt: str = "PNG") -> bytes:
    """A random RGB picture, encoded as `fmt`."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


@functools.lru_cache(maxsize=2)
def load(model_dir: str):
    """(model, processor): transformers' own, float32, eager attention."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoProcessor.from_pretrained(model_dir)


def processed(model_dir, text: str, images: list[bytes]) -> tuple[list[int], torch.Tensor | None]:
    """The processor's input ids and pixel values for `text` (with `<image>` where each image goes)."""
    from PIL import Image

    _, processor = load(str(model_dir))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
    out = processor(text=text, images=pil, return_tensors="pt")
    return out["input_ids"][0].tolist(), out.get("pixel_values")


def reference_generate(model_dir, text: str, images: list[bytes], max_new_tokens: int) -> list[int]:
    """Greedy new tokens of transformers' generate() on the processor's inputs (batch 1)."""
    model, _ = load(str(model_dir))
    ids, pixels = processed(model_dir, text, images)
    input_ids = torch.tensor([ids])
    kwargs = {} if pixels is None else {"pixel_values": pixels}
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, input_ids.shape[1] :].tolist()
