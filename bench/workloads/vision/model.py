"""The vision workload's model and requests: a LLaVA 1.5-shaped model built here without the Hub, photo-like
pictures as data: URIs, and the three kinds of request cut alike (an image's prompt, text of the same token count,
the same text without the image)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

from bench import models
from bench.serving import loadgen
from bench.serving.workload import Prompts

# LLaVA 1.5's image input (CLIP ViT-L/14-336: 24 x 24 patches, the CLS feature dropped); the tower itself smaller
IMAGE_SIDE, PATCH = 336, 14
TOWERS = {
    "smollm2": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
    "llama-128k": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
}
IMAGE_TOKEN = "<image>"
KINDS = ("image", "text, same tokens", "text, no image")
DIALECT = loadgen.Dialect("tgi")


def build_llava(shape: str) -> Path:
    """Build (once) the LLaVA 1.5-shaped model whose language model has `shape` (a key of bench.models.SHAPES)."""
    out = models.CACHE / f"llava-{shape}"
    if (out / "model.safetensors").exists():
        return out
    import torch
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

    vocab = models.VOCABS.get(shape, models.VOCAB)
    tok_dir = models.build_tokenizer(models.CACHE / ("tokenizer" if vocab == models.VOCAB else f"tokenizer-{vocab}"))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer_config.json").write_bytes((tok_dir / "tokenizer_config.json").read_bytes())
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(tmp / "tokenizer.json"))
    text = LlamaConfig(vocab_size=tok.get_vocab_size(), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       **models.SHAPES[shape])  # fmt: skip
    vision = CLIPVisionConfig(image_size=IMAGE_SIDE, patch_size=PATCH, **TOWERS.get(shape, TOWERS["smollm2"]))
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.token_to_id(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)  # transformers' own init: realistic magnitudes
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(tmp, safe_serialization=True)
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE},
                                   crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})  # fmt: skip
    processor = LlavaProcessor(image_processor=images, tokenizer=PreTrainedTokenizerFast.from_pretrained(tmp),
                               patch_size=PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)  # fmt: skip
    processor.save_pretrained(tmp)
    tmp.rename(out)
    return out


def picture(seed: int, size: tuple[int, int], fmt: str) -> bytes:
    """A photo-like picture (soft colour fields, a dozen shapes, a little sensor noise): it compresses as a photo
    does (PNG ~0.5 MB, JPEG ~50 KB at 640x480), unlike pure noise or flat colour."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.fromarray((rng.random((6, 8, 3)) * 255).astype("uint8")).resize(size, Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x0, y0, x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))]
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    pixels = np.asarray(img.filter(ImageFilter.GaussianBlur(2))).astype(np.int16)
    pixels += rng.normal(0, 4, pixels.shape).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype("uint8")).save(
        buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {})
    )
    return buf.getvalue()


class Pictures:
    """Distinct pictures as data: URIs, PNG and JPEG in turn, from seeds counted up: no two measured requests share
    one, so neither the prefix cache nor the encoder's batching sees the same image twice (the flood's requests,
    which are never prefilled, take turns over a pool of them)."""

    def __init__(self, size: tuple[int, int], seed: int = 0):
        self.size, self.next = size, seed
        self.bytes: dict[str, list[int]] = {"PNG": [], "JPEG": []}

    def uri(self) -> str:
        fmt = ("PNG", "JPEG")[self.next % 2]
        data = picture(self.next, self.size, fmt)
        self.next += 1
        self.bytes[fmt].append(len(data))
        return f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()


@dataclass
class Jobs:
    """The three kinds of request, cut alike: the image's prompt, its text-only twin of the same token count,
    and the same text without the image."""

    prompts: Prompts
    pictures: Pictures
    text_tokens: int
    image_prompt_tokens: int
    output_tokens: int

    def make(self, kind: str, count: int, output_tokens: int | None = None) -> list[loadgen.Job]:
        out = output_tokens or self.output_tokens
        length = self.image_prompt_tokens if kind == "text, same tokens" else self.text_tokens
        jobs = []
        for _ in range(count):
            text, n = self.prompts.make(length)
            while IMAGE_TOKEN in text:  # a text that names the image token would be read as an image
                text, n = self.prompts.make(length)
            if kind == "image":
                jobs.append(loadgen.Job(f"![]({self.pictures.uri()})\n{text}", self.image_prompt_tokens, out))
            else:
                jobs.append(loadgen.Job(text, n, out))
        return jobs
