"""LoRA adapters for the tests, built offline with peft on the tiny models, and peft's own logits as the reference.

A and B are drawn at random (peft starts B at zero, which would hide any mistake in the B side and in the scaling)
and saved as peft saves them. tests/conftest.py builds `ADAPTERS` once per session (`build_adapters`,
`build_reference`); the shard's and the end-to-end LoRA tests build their own with `build_adapter`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

peft = pytest.importorskip("peft")

# Ours and peft's differ only in summation order (B folded with its scale, oneDNN / fused q/k/v products):
# measured max |diff| 4.9e-6 (llama) and 3.9e-6 (qwen2) on logits of magnitude ~10, so 5e-5 is a 10x margin,
# while a wrong scale, slot or row moves the logits by more than 1e-1
# (asserted in tests/services/shard/lora/test_registry.py).
ATOL = 5e-5

ADAPTERS = {
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "qv_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(
        r=8,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
        exclude_modules=["k_proj"],
        layers_to_transform=[1],
        rank_pattern={"o_proj": 4},
        alpha_pattern={"down_proj": 3},
    ),
    "regex": dict(r=2, lora_alpha=5, target_modules=r".*\.0\.(self_attn\.v_proj|mlp\.up_proj)"),
}


def base_model(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def build_adapter(model_dir, out, seed: int, **kwargs):
    model = peft.get_peft_model(base_model(model_dir), peft.LoraConfig(lora_dropout=0.0, **kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(out)
    return out


def build_adapters(tiny_dirs, root) -> dict:
    """(arch, name) → folder of every ADAPTERS entry on the tiny llama and qwen2."""
    return {
        (arch, name): build_adapter(tiny_dirs[arch], root / arch / name, seed=i, **cfg)
        for arch in ("llama", "qwen2")
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


def build_reference(tiny_dirs, adapters) -> dict:
    """arch → PeftModel holding every adapter of that arch."""
    refs = {}
    for arch in ("llama", "qwen2"):
        names = list(ADAPTERS)
        ref = peft.PeftModel.from_pretrained(
            base_model(tiny_dirs[arch]), adapters[arch, names[0]], adapter_name=names[0]
        )
        for name in names[1:]:
            ref.load_adapter(adapters[arch, name], adapter_name=name)
        refs[arch] = ref.eval()
    return refs


def peft_logits(ref, name: str | None, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if name is None:
            with ref.disable_adapter():
                return ref(input_ids=input_ids).logits
        ref.set_adapter(name)
        return ref(input_ids=input_ids).logits
