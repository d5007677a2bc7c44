"""Tiny random-weight vision-language models built locally (no Hub), one per served family, with their real processors,
and transformers' own greedy generate() on the processor's inputs as the reference.

Every family is the tiny byte-level tokenizer (tests/tiny_models.py) with the family's image tokens added, a small
vision tower (`tiny_tower`) and a small language model (`tiny_text`), its weights drawn so its logits are peaked (the
image steers them), and its processor saved beside it. `processed` and `reference_generate` serve every family."""

from __future__ import annotations

import base64
import functools
import io
import json
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import (
    BOS,
    EMBED_STD,
    EOS,
    GEMMA_EMBED_STD,
    GEMMA_FINAL_GAIN,
    GEMMA_NORM_GAIN,
    PAD,
    WEIGHT_STD,
    build_tokenizer,
)

IMAGE_SIZE, PATCH = 28, 7  # 16 patches: 16 placeholder tokens per image (CLS dropped, "default" selection)
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
LLAMA_HEADS = dict(head_dim=16, num_key_value_heads=4)  # the Llama language models: multi-head attention


def tiny_tower(**config) -> dict:
    """A vision tower's config: 2 layers, 32 wide, with the family's image and patch sizes in `config`."""
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **config)


def tiny_text(tok, **config) -> dict:
    """A language model's config over the tokenizer `tok`: 2 layers, 64 wide, 4 heads; `config` adds or overrides."""
    base = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return {**base, **config}


def _built(out: Path, marker: str = "processor_config.json") -> bool:
    return (out / "model.safetensors").exists() and (out / marker).exists()


def _tokenizer(out: Path, tokens: list[str]):
    """The tiny tokenizer written into `out`, with `tokens` added as specials."""
    from tokenizers import AddedToken, Tokenizer

    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(out / "tokenizer.json"))
    return tok


def _peaked(name: str, p: torch.Tensor, randn):
    """Peaked logits, as the tiny text models (tests/tiny_models.py): large embeddings and matrices."""
    if "embed_tokens" in name:
        return randn(p.shape) * EMBED_STD
    if p.ndim >= 2:
        return randn(p.shape) * WEIGHT_STD
    return None  # transformers' own init (norms, biases), seeded


def _save_model(out: Path, config, seed: int, draw=_peaked) -> None:
    """The model of `config` (transformers' image-text-to-text class for it), seeded, each weight redrawn by
    `draw(name, weight, randn)` where it returns a value, saved into `out` with greedy generation defaults."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = draw(name, p, lambda shape: torch.randn(shape, generator=gen))
            if value is not None:
                p.copy_(value)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)


def image(seed: int, size=(40, 30), fmt: str = "PNG") -> bytes:
    """A random RGB picture, encoded as `fmt`."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """`data` as a data: URI, as a request carries an image inline."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------------------------
# LLaVA 1.5 and LLaVA-Next: a CLIP vision tower, the two-layer projector and a Llama, with the real processor
# (LlavaProcessor, LlavaNextProcessor over their PIL image processors). LLaVA-Next tiles anyres: an image is resized to
# the grid resolution (LLAVA_NEXT_GRID) that best fits its size and cut into 28x28 tiles after a 28x28 base view, and
# the tiles' features are unpadded back to its aspect with an image_newline closing each row, so its processor counts
# the placeholders from the image's size: a 40x30 picture takes 5 views and 70 tokens, 30x30 5 views and 88, 24x40
# 3 views and 46.

LLAVA_NEXT_GRID = [[28, 56], [56, 28], [56, 56]]


def build_llava(out_dir: str | Path, seed: int = 0) -> Path:
    """Build (once) the tiny LLaVA 1.5 into `out_dir`; returns the folder."""
    return _build_llava(Path(out_dir), seed, grid=None)


def build_llava_next(out_dir: str | Path, seed: int = 0) -> Path:
    """Build (once) the tiny LLaVA-Next into `out_dir`; returns the folder."""
    return _build_llava(Path(out_dir), seed, grid=LLAVA_NEXT_GRID)


def _build_llava(out: Path, seed: int, grid: list | None) -> Path:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaNextConfig,
        LlavaNextProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    if _built(out):
        return out
    tok = _tokenizer(out, ["<image>"])
    config = dict(
        vision_config=CLIPVisionConfig(**tiny_tower(image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)),
        text_config=LlamaConfig(**tiny_text(tok, **LLAMA_HEADS)),
        image_token_id=tok.token_to_id("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    crop = dict(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    if grid is None:
        _save_model(out, LlavaConfig(**config), seed)
        images, processor = CLIPImageProcessorPil(**crop), LlavaProcessor
    else:  # image_newline: transformers' own init, seeded
        _save_model(out, LlavaNextConfig(**config, image_grid_pinpoints=grid), seed)
        images, processor = LlavaNextImageProcessorPil(**crop, image_grid_pinpoints=grid), LlavaNextProcessor
    processor(
        image_processor=images,
        tokenizer=PreTrainedTokenizerFast.from_pretrained(out),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    ).save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Qwen2-VL and Qwen2.5-VL: a vision transformer (2-D rotary, patch merger; 2.5: window attention) and a Qwen2
# language model with M-RoPE, their image processor (PIL path) and the tiny tokenizer with Qwen's vision tokens. Their
# processor class needs torchvision (its video part): `processed` expands each image as Qwen2VLProcessor does, one
# <|image_pad|> per merged patch, framed by <|vision_start|> <|vision_end|> as the chat template frames an image.

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
QWEN_PATCH, QWEN_MERGE = 4, 2  # a 40x30 picture: 8x10 patches, 4x5 = 20 image tokens
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_qwen_vl(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """Build (once) a tiny Qwen2-VL (`family` "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") into `out_dir`."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    if _built(out, "preprocessor_config.json"):
        return out
    tok = _tokenizer(out, QWEN_TOKENS)
    start, end, image_pad, video_pad = (tok.token_to_id(t) for t in QWEN_TOKENS)
    ids = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image_pad, video_token_id=video_pad)
    # head_dim 16: 8 rotary frequencies, 2 for the temporal section, 3 each for height and width
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = tiny_text(tok, num_key_value_heads=2, rope_parameters=rope)
    common = dict(patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=2, depth=2, num_heads=2)
    if family == "qwen2_vl":
        vision = dict(embed_dim=32, mlp_ratio=2, hidden_size=64, **common)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    else:  # windows of 2x2 merged patches, the second block attending to the whole image
        vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=16, **common)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, fullatt_block_indexes=[1]), **ids)
    _save_model(out, config, seed)
    side = QWEN_PATCH * QWEN_MERGE
    Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": (8 * side) ** 2},  # at most 8x8 image tokens
    ).save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Gemma 3: a SigLIP tower, the projector's average pooling to mm_tokens_per_image tokens and a Gemma 3 language
# model (sliding and full layers), with its real processor (Gemma3Processor over Gemma 3's PIL image processor and
# the tiny tokenizer with Gemma 3's image tokens), whose image block of the prefill is attended both ways. Its image
# placeholder in a prompt is `<start_of_image>`.

GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_IMAGE_TOKENS = 4  # 4x4 patches pooled 2x2
PROJECTION_STD = 1.0


def _gemma3_weight(name: str, p: torch.Tensor, randn):
    """Peaked logits as `_peaked`, at Gemma's scales."""
    if "embed_tokens" in name:  # Gemma scales its embeddings by sqrt(hidden)
        return randn(p.shape) * GEMMA_EMBED_STD
    if "mm_input_projection" in name:  # image rows as large as the scaled text embeddings
        return randn(p.shape) * PROJECTION_STD
    if p.ndim >= 2:
        return randn(p.shape) * WEIGHT_STD
    if "language_model" in name and "norm" in name:  # as tests/tiny_models.py: Gemma norms are x * (1 + w)
        gain = GEMMA_FINAL_GAIN if name.endswith("language_model.norm.weight") else GEMMA_NORM_GAIN
        return gain - 1 + randn(p.shape) * 0.2
    return None


def build_gemma3(out_dir: str | Path, seed: int = 0, sliding_window: int = 6) -> Path:
    """Build (once) the tiny Gemma 3 vision model into `out_dir`; returns the folder. A `sliding_window` under
    GEMMA3_IMAGE_TOKENS has the window cut an image's bidirectional block, as transformers composes them."""
    from transformers import (
        Gemma3Config,
        Gemma3Processor,
        Gemma3TextConfig,
        PreTrainedTokenizerFast,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = Path(out_dir)
    if _built(out):
        return out
    tok = _tokenizer(out, list(GEMMA3_TOKENS.values()))
    ids = {k: tok.token_to_id(t) for k, t in GEMMA3_TOKENS.items()}
    text = tiny_text(
        tok,
        head_dim=16,
        num_hidden_layers=4,
        num_key_value_heads=2,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    config = Gemma3Config(
        vision_config=SiglipVisionConfig(**tiny_tower(image_size=28, patch_size=7)),
        text_config=Gemma3TextConfig(**text),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )
    _save_model(out, config, seed, draw=_gemma3_weight)
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), extra_special_tokens=GEMMA3_TOKENS)
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=GEMMA3_IMAGE_TOKENS).save_pretrained(
        out
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Idefics3 and SmolVLM2: a SigLIP-like tower over each tile of an image, the connector's pixel shuffle and projection,
# and a Llama language model, with Idefics3's real processor (Idefics3Processor over its PIL image processor and the
# tiny tokenizer with its image, frame, global-image and row/column tokens). An image is split into tiles plus a global
# image, each tile's placeholders framed by <fake_token_around_image> and its row/column marker. SmolVLMProcessor
# cannot be built here (its video part needs torchvision): `processed` runs SmolVLM2's PIL image processor and
# expands each image by transformers' get_image_prompt_string, as SmolVLMProcessor does.

IDEFICS3_FAMILIES = ("idefics3", "smolvlm")
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
IDEFICS3_TILE, IDEFICS3_PATCH, IDEFICS3_SCALE = 28, 7, 2  # 4x4 patches shuffled 2x2: 4 image tokens per tile
IDEFICS3_TILE_TOKENS = (IDEFICS3_TILE // IDEFICS3_PATCH) ** 2 // IDEFICS3_SCALE**2


def build_idefics3(out_dir: str | Path, seed: int = 0, family: str = "idefics3") -> Path:
    """Build (once) the tiny Idefics3 (`family` "idefics3") or SmolVLM2 ("smolvlm") into `out_dir`: an image's
    longest edge resized to two tiles, so a 40x30 picture makes 2x2 tiles and the global image (5 x 4 image tokens),
    a 40x12 one 1x2 tiles and the global one."""
    from transformers import AutoConfig, Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    out = Path(out_dir)
    if _built(out):
        return out
    tok = _tokenizer(out, IDEFICS3_TOKENS)
    config = AutoConfig.for_model(
        family,
        vision_config=tiny_tower(image_size=IDEFICS3_TILE, patch_size=IDEFICS3_PATCH),
        text_config=tiny_text(tok, model_type="llama", **LLAMA_HEADS),
        scale_factor=IDEFICS3_SCALE,
        image_token_id=tok.token_to_id("<image>"),
        tie_word_embeddings=False,
    )
    _save_model(out, config, seed)
    sizes = dict(size={"longest_edge": 2 * IDEFICS3_TILE}, max_image_size={"longest_edge": IDEFICS3_TILE})
    if family == "smolvlm":  # its image processor and tokenizer only (SmolVLMProcessor needs torchvision)
        SmolVLMImageProcessorPil(**sizes).save_pretrained(out)
        PreTrainedTokenizerFast.from_pretrained(out).save_pretrained(out)
        (out / "processor_config.json").write_text(json.dumps({"image_seq_len": IDEFICS3_TILE_TOKENS}))
        return out
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)  # its config's BOS/EOS, which the chat template reads
    Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**sizes), tokenizer=tokenizer, image_seq_len=IDEFICS3_TILE_TOKENS
    ).save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The reference: transformers' own model and processor, float32, eager attention.

IMAGE_PROCESSOR_ONLY = (*QWEN_FAMILIES, "smolvlm")  # processor classes that need torchvision (their video part)


@functools.lru_cache(maxsize=8)
def load(model_dir: str):
    """(model, processor): the folder's processor, or (image processor, tokenizer) for a family whose processor class
    needs torchvision."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if model.config.model_type in IMAGE_PROCESSOR_ONLY:
        return model.eval(), (AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))
    return model.eval(), AutoProcessor.from_pretrained(model_dir)


def processed(model_dir, text: str, images: list[bytes]) -> dict:
    """generate()'s inputs for `text` with the model's placeholder (`<image>`; Gemma 3's `<start_of_image>`) where
    each image goes: the processor's own tensors (input ids; with images their pixels and what the family adds)."""
    from PIL import Image

    model, processor = load(str(model_dir))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
    if model.config.model_type in QWEN_FAMILIES:
        return _qwen_processed(model, *processor, text, pil)
    if model.config.model_type == "smolvlm":
        return _smolvlm_processed(*processor, text, pil)
    return processor(text=text, images=pil, return_tensors="pt")


def prompt_ids(model_dir, text: str, images: list[bytes]) -> list[int]:
    """The processor's input ids for `text` and `images` (as `processed`)."""
    return processed(model_dir, text, images)["input_ids"][0].tolist()


def _qwen_processed(model, image_processor, tokenizer, text: str, pil: list | None) -> dict:
    """As Qwen2VLProcessor: one <|image_pad|> per merged patch, framed by <|vision_start|> <|vision_end|>."""
    kwargs = {}
    if pil:
        got = image_processor(images=pil, return_tensors="pt")
        counts = (got["image_grid_thw"].prod(-1) // QWEN_MERGE**2).tolist()
        parts = text.split("<image>")
        text = parts[0] + "".join(
            "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" + rest for n, rest in zip(counts, parts[1:])
        )
        kwargs = {"pixel_values": got["pixel_values"], "image_grid_thw": got["image_grid_thw"]}
    input_ids = torch.tensor([tokenizer(text)["input_ids"]])
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    return dict(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm_token_type_ids, **kwargs
    )


def _smolvlm_processed(image_processor, tokenizer, text: str, pil: list | None) -> dict:
    """As SmolVLMProcessor: each image expanded by transformers' get_image_prompt_string."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    got = {}
    if pil:
        got = image_processor(images=[pil], return_row_col_info=True, return_tensors="pt")
        parts = text.split("<image>")
        text = parts[0] + "".join(
            get_image_prompt_string(
                rows, cols, IDEFICS3_TILE_TOKENS, "<fake_token_around_image>", "<image>", "<global-img>"
            )
            + rest
            for rows, cols, rest in zip(got.pop("rows")[0], got.pop("cols")[0], parts[1:])
        )
    return dict(tokenizer(text, return_tensors="pt"), **got)


def reference_generate(model_dir, text: str, images: list[bytes], max_new_tokens: int) -> list[int]:
    """Greedy new tokens of transformers' generate() on the processor's inputs (batch 1)."""
    model, _ = load(str(model_dir))
    inputs = processed(model_dir, text, images)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
