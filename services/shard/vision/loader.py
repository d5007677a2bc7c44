"""Loading a vision-language model: the whole model (vision tower, projector, language model) with the paged
attention on its language model only, and the language model alone as a causal LM sharing the same modules, which
the runner walks as any text model (the decoder walk or transformers' forward)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from services.shard.vision import gemma3, idefics3, llava_next, qwen2_vl

# families whose image embeddings replace their placeholder tokens' embeddings one for one (encoder.py)
FAMILIES = {"llava", *llava_next.FAMILIES, *qwen2_vl.FAMILIES, *gemma3.FAMILIES, *idefics3.FAMILIES}


def is_vision_config(config: dict) -> bool:
    """Whether a folder's config.json (as a dict) describes a vision-language model."""
    return "vision_config" in config and "text_config" in config


def attn_implementation(paged: str) -> dict[str, str]:
    """The paged attention for the language model; transformers' eager one for the vision tower (as the reference
    runs it: the encoder's output is bit for bit the same)."""
    return {"text_config": paged, "vision_config": "eager", "": "eager"}


def check_family(model: torch.nn.Module) -> None:
    family = model.config.model_type
    if family not in FAMILIES:
        raise ValueError(f"vision-language family {family!r} is not served (served: {', '.join(sorted(FAMILIES))})")


def from_pretrained(model_dir: str, *, attn: str, **kwargs) -> torch.nn.Module:
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, attn_implementation=attn_implementation(attn), **kwargs
    )
    check_family(model)
    return model


def from_config(config, *, attn: str, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn_implementation(attn))
    check_family(model)
    return model


def uses_mrope(model: torch.nn.Module) -> bool:
    """Whether the model places image tokens by M-RoPE (3-D positions: services/shard/vision/mrope.py)."""
    return model.config.model_type in qwen2_vl.FAMILIES


def is_vision_model(model: torch.nn.Module) -> bool:
    return hasattr(model.config, "vision_config") and language_model(model) is not None


def language_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision model's language model (Idefics3 and SmolVLM call it text_model), or None."""
    inner = getattr(model, "model", None)
    found = getattr(inner, "language_model", None)
    return found if found is not None else getattr(inner, "text_model", None)


def text_model(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    """The language model and LM head of `model` as transformers' causal LM of its text config: a shell built
    without weights whose body and head ARE the vision model's modules (nothing is copied)."""
    if model.config.model_type in qwen2_vl.FAMILIES:  # no causal LM class in transformers for their text config
        return qwen2_vl.causal_lm(model)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(model.config.get_text_config(), attn_implementation=attn)
    shell.model = language_model(model)
    shell.lm_head = model.get_output_embeddings()
    return shell


def attends_images_both_ways(model: torch.nn.Module) -> bool:
    """Whether an image's tokens attend to each other both ways in prefill (services/shard/vision/gemma3.py)."""
    return model.config.model_type in gemma3.FAMILIES
