"""Reading one peft LoRA adapter folder against a base model: which linears it targets, at which rank and scale.

A folder written by peft's `save_pretrained` holds `adapter_config.json` and `adapter_model.safetensors` (keys
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]). The targeted modules are
decided from the config as peft decides them (target_modules as name suffixes or a full-match regex, `all-linear`,
layers_to_transform / layers_pattern, exclude_modules; each module's rank and alpha from rank_pattern /
alpha_pattern), then the file must hold exactly those modules' A and B with shapes that fit the base layers. The
scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B here, so serving is two plain matmuls.

Everything we cannot serve exactly is refused with an `AdapterError` naming the adapter and the problem, before
anything is installed: a request never meets a half-loaded adapter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_LAYER_INDEX_ANY = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


class AdapterError(ValueError):
    """An adapter that cannot be loaded; the message names it and says why (meant for the user as is)."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    # module name in the base model → (A [r, in], B [out, r] with the scaling folded in)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _config(name: str, folder: Path) -> dict:
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: folder {folder} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: malformed {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"LoRA adapter {name!r}: malformed {CONFIG_FILE}: not a JSON object")
    bad = _unsupported(cfg)
    if bad:
        raise AdapterError(f"LoRA adapter {name!r}: {bad}")
    problem = _malformed(cfg)
    if problem:
        raise AdapterError(f"LoRA adapter {name!r}: malformed {CONFIG_FILE}: {problem}")
    return cfg


def _unsupported(cfg: dict) -> str | None:
    """Features whose forward is not y + B A x; serving without them would silently change the outputs."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        return f"is a {peft_type} adapter; only LoRA adapters are supported"
    if cfg.get("use_dora"):
        return "uses DoRA (use_dora: true), which is not supported"
    if cfg.get("modules_to_save"):
        return f"trains whole modules (modules_to_save: {cfg['modules_to_save']}), which is not supported"
    if cfg.get("bias", "none") not in (None, "none"):
        return f"trains biases (bias: {cfg['bias']!r}), which is not supported"
    if cfg.get("lora_bias"):
        return "has a bias on lora_B (lora_bias: true), which is not supported"
    if cfg.get("target_parameters"):
        return f"targets parameters (target_parameters: {cfg['target_parameters']}), which is not supported"
    if cfg.get("layer_replication"):
        return "replicates layers (layer_replication), which is not supported"
    if cfg.get("trainable_token_indices"):
        return "trains token embeddings (trainable_token_indices), which is not supported"
    return None


def _malformed(cfg: dict) -> str | None:
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return f"`r` must be a positive integer, got {r!r}"
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return f"`lora_alpha` must be a number, got {alpha!r}"
    targets = cfg.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        return f"`target_modules` must be a list of names or a regex string, got {targets!r}"
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            return f"`{key}` must be an object, got {cfg[key]!r}"
    if any(not isinstance(v, int) or v < 1 for v in (cfg.get("rank_pattern") or {}).values()):
        return f"`rank_pattern` values must be positive integers, got {cfg['rank_pattern']!r}"
    layers = cfg.get("layers_to_transform")
    if layers is not None and not isinstance(layers, int) and not isinstance(layers, list):
        return f"`layers_to_transform` must be an integer or a list, got {layers!r}"
    excluded = cfg.get("exclude_modules")
    if excluded is not None and not isinstance(excluded, (str, list)):
        return f"`exclude_modules` must be a list of names or a regex string, got {excluded!r}"
    return None


def _targeted(cfg: dict, key: str, linear_names: set[str]) -> bool:
    """Whether peft puts a LoRA layer on the module `key` (its name in the base model)."""
    excluded = cfg.get("exclude_modules")
    if excluded:
        if isinstance(excluded, str):
            if re.fullmatch(excluded, key):
                return False
        elif key in excluded or any(key.endswith(f".{e}") for e in excluded):
            return False
    targets = cfg["target_modules"]
    if targets == "all-linear":  # peft expands it to the last names of every linear but the output layer
        targets = sorted(linear_names)
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = cfg.get("layers_pattern")
    match = None
    if not pattern:
        match = _LAYER_INDEX_ANY.match(key)
    else:
        for p in [pattern] if isinstance(pattern, str) else pattern:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if match:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _pattern_value(patterns: dict, key: str, default):
    """peft's rule: the first pattern that matches a suffix of `key` (as a regex) gives the value."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _shape(t) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def load_adapter(
    name: str,
    folder: str | Path,
    model: torch.nn.Module,
    *,
    max_rank: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> LoraAdapter:
    """Read and check the adapter in `folder` against `model`; A and B come back in `dtype` on `device`
    (default: the base model's), B already scaled."""
    from safetensors import safe_open

    folder = Path(folder)
    cfg = _config(name, folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        also = " (adapter_model.bin is pickle, which is not read: save with safe_serialization)"
        raise AdapterError(
            f"LoRA adapter {name!r}: {folder} has no {WEIGHTS_FILE}" + also * (folder / "adapter_model.bin").exists()
        )

    modules = dict(model.named_modules())
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear_names = {n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    linear_names -= {n.rsplit(".", 1)[-1] for n, m in modules.items() if m is output_layer}
    targeted: dict[str, torch.nn.Linear] = {}
    for key, module in modules.items():
        if not key or not _targeted(cfg, key, linear_names):
            continue
        if module is output_layer:
            raise AdapterError(f"LoRA adapter {name!r} targets the LM head `{key}`, which is not supported")
        if isinstance(module, torch.nn.Embedding):
            raise AdapterError(f"LoRA adapter {name!r} targets the embedding `{key}`, which is not supported")
        if not isinstance(module, torch.nn.Linear):
            raise AdapterError(
                f"LoRA adapter {name!r} targets `{key}`, a {type(module).__name__}: only linear layers are supported"
            )
        targeted[key] = module
    if not targeted:
        raise AdapterError(f"LoRA adapter {name!r}: target_modules {cfg['target_modules']!r} match no linear layer")

    r, alpha = cfg["r"], cfg.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    ref = next(iter(targeted.values())).weight
    dtype, device = dtype or ref.dtype, device or ref.device
    adapter = LoraAdapter(name=name, path=str(folder), rank=0)
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            stored = {k.removeprefix(_PREFIX): k for k in f.keys()}
            for key in stored:
                if ".lora_embedding_" in key:
                    raise AdapterError(f"LoRA adapter {name!r} targets an embedding ({key}), which is not supported")
                module_name = key.rsplit(".lora_", 1)[0]
                if module_name not in targeted:
                    raise AdapterError(
                        f"LoRA adapter {name!r} holds weights for `{module_name}`, which is not a module its "
                        "config targets in this base model (trained on another model?)"
                    )
            for key, module in targeted.items():
                rank = _pattern_value(rank_pattern, key, r)
                module_alpha = _pattern_value(alpha_pattern, key, alpha)
                if max_rank is not None and rank > max_rank:
                    raise AdapterError(
                        f"LoRA adapter {name!r}: rank {rank} of `{key}` is above the maximum LoRA rank {max_rank}"
                    )
                a_key, b_key = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
                if a_key not in stored or b_key not in stored:
                    raise AdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} lacks lora_A/lora_B of `{key}`")
                a, b = f.get_tensor(stored[a_key]), f.get_tensor(stored[b_key])
                if a.shape != (rank, module.in_features) or b.shape != (module.out_features, rank):
                    raise AdapterError(
                        f"LoRA adapter {name!r} does not fit the base model: `{key}` takes {module.in_features} "
                        f"inputs to {module.out_features} outputs at rank {rank}, but lora_A is {_shape(a)} and "
                        f"lora_B is {_shape(b)}"
                    )
                scale = module_alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
                b = b.to(torch.float32) * scale  # folded in float32, then cast once
                adapter.weights[key] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
                adapter.rank = max(adapter.rank, rank)
    except AdapterError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors' own error, under the adapter's name
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {WEIGHTS_FILE}: {e}") from None
    return adapter


def check_adapters(model_dir: str | Path, folders: dict[str, str], *, max_rank: int | None = None) -> None:
    """Read every adapter against the model's architecture built on the meta device (no weights loaded), so the
    launcher refuses a bad adapter with its reason before any service starts; raises the first AdapterError."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for name, folder in folders.items():
        load_adapter(name, folder, model, max_rank=max_rank, device="meta")
