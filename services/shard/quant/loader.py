"""Quantized models on CPU: each float linear replaced by its quantized layer (services/shard/quant/layers.py), as a
checkpoint is read (`from_pretrained`) or a float model is quantized at load (`quantize_model`); under tensor
parallelism each rank keeps its share of every quantized layer. The layers themselves live in
services/shard/quant/layers.py.
"""

from __future__ import annotations

import re

import torch

from services.shard.model.onednn import FUSED_GROUPS
from services.shard.quant.formats import QuantWeight, shard_for_rank
from services.shard.quant.layers import QuantLinear, build, fuse_w8a8
from services.shard.tensor_parallel import tp_split


def replace_linears(model: torch.nn.Module, weights: dict[str, QuantWeight], **kw) -> int:
    """Put a quantized module in place of each named linear of `model`; returns how many were replaced."""
    for name, qw in weights.items():
        _replace(model, name, qw, **kw)
    return len(weights)


def _replace(model: torch.nn.Module, name: str, qw: QuantWeight, **kw) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    if tuple(qw.shape) != (old.out_features, old.in_features):
        raise ValueError(f"{name}: quantized shape {tuple(qw.shape)} ≠ the model's {old.weight.shape}")
    if qw.bias is None and getattr(old, "bias", None) is not None:
        qw.bias = _whole(old.bias).detach().float()
    split, offset, size = tp_split(old)
    if split is not None:
        qw = shard_for_rank(qw, split, offset, size)
    layer = build(qw, **kw)
    layer.weight_dtype = old.weight.dtype
    if split is not None:
        _tensor_parallel(model, name, layer, old)
    setattr(parent, attr, layer)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor gathered whole (a collective: every rank calls it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tensor_parallel(model: torch.nn.Module, name: str, layer: QuantLinear, old: torch.nn.Module) -> None:
    """Give a rank's quantized layer the forward that transformers' tensor-parallel plan gave the dense one (the
    input split or replicated, the partial outputs summed over the ranks)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    plan = getattr(model, "_tp_plan", None) or {}
    style = next((s for p, s in plan.items() if re.fullmatch(re.escape(p).replace(r"\*", r"\d+"), name)), None)
    if style not in ("colwise", "rowwise"):
        raise ValueError(f"{name}: tensor-parallel style {style!r} has no quantized layer")
    layer.out_features, layer.in_features = old.out_features, old.in_features  # the whole layer's, as for dense
    layer.tensor_parallel = True
    if style == "rowwise" and layer.bias is not None:  # added by transformers to the summed output, in its dtype
        layer.bias.data = layer.bias.data.to(layer.weight_dtype)
    ALL_PARALLEL_STYLES[style].install_forward(layer, model._device_mesh)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc): the float weights that quantized layers replaced
    were freed in pieces of a few MiB, which glibc keeps in its heap (until this, the shard's RSS stays at the float
    model's size plus the quantized one's)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return
    if trim is not None:
        trim(0)


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the tensors a quantized layer keeps (for the benchmark's memory column)."""
    tensors = [t for t in [*vars(module).values(), *module._parameters.values()] if isinstance(t, torch.Tensor)]
    # a storage once however many attributes view it, and no more of it than the module views (the members of a
    # fused W8A8 product each view their own columns of one shared storage)
    by_storage: dict[int, tuple[int, dict]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        views = by_storage.setdefault(storage.data_ptr(), (storage.nbytes(), {}))[1]
        views[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
    return sum(min(whole, sum(views.values())) for whole, views in by_storage.values())


def quantize_model(model: torch.nn.Module, method: str, nf4_group: int = 64) -> int:
    """Quantize a float model's linear layers at load (the LM head stays dense, as in bitsandbytes):
    bitsandbytes / eetq → W8A8; bitsandbytes-nf4 / -fp4 → 4-bit group-wise, asymmetric round-to-nearest."""
    from services.shard.quant.formats import quantize_rtn

    names = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear
             and name.rsplit(".", 1)[-1] != "lm_head"]  # fmt: skip
    # one layer at a time, replaced as soon as it is quantized: its float weight is freed before the next is read,
    # so the quantized copies never sit beside the whole float model
    replaced = 0
    for name in names:
        module = model.get_submodule(name)
        if module.weight.device.type != "cpu":
            continue  # accelerator weights keep their own path
        # under tensor parallelism each rank quantizes the whole weight and keeps its part (_replace): its scales
        # are the single-process ones, split with the weights
        w, bias = _whole(module.weight).detach(), None if module.bias is None else _whole(module.bias).detach()
        if method in ("bitsandbytes", "eetq"):
            qw = quantize_rtn(w, 8, -1, symmetric=True, act_int8=True, bias=bias)
        elif method in ("bitsandbytes-nf4", "bitsandbytes-fp4"):
            split, _, size = tp_split(module)  # a rank's input columns must hold whole groups
            k = size if split == "row" else w.shape[1]
            group = next((g for g in (nf4_group, 32) if k % g == 0 and w.shape[1] % g == 0), w.shape[1])
            qw = quantize_rtn(w, 4, group, symmetric=False, bias=bias)
        else:
            raise ValueError(f"{method} is not quantized at load")
        del w, module
        _replace(model, name, qw)
        replaced += 1
    fuse_w8a8(model, FUSED_GROUPS)
    release_freed_memory()
    return replaced


def from_pretrained(model_dir: str, method: str, **kwargs) -> torch.nn.Module:
    """transformers' model for `model_dir` with its linears quantized by `method`: a pre-quantized checkpoint's
    layers are read in their own layout (transformers loads the rest: embeddings, norms, LM head), a float one is
    quantized after load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.shard.quant.formats import read_checkpoint

    if method not in ("gptq", "awq", "compressed-tensors"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        quantize_model(model, method)
        _off_the_file(model)
        return model
    config = AutoConfig.from_pretrained(model_dir)
    qconfig = getattr(config, "quantization_config", None) or getattr(config, "compression_config", None) or {}
    for attr in ("quantization_config", "compression_config"):
        if hasattr(config, attr):
            delattr(config, attr)  # transformers' quantizers would take over (and want their CUDA packages)
    weights = read_checkpoint(model_dir, method, dict(qconfig))
    # the quantized layers' dense weights are absent from the files: transformers initialises them (and reports
    # every packed tensor as unexpected, quieted here: the replacement below checks each one), then they go
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    replace_linears(model, weights)
    fuse_w8a8(model, FUSED_GROUPS)  # compressed-tensors' int-quantized (W8A8) checkpoints
    del weights
    _off_the_file(model)
    _check_no_linear_left_random(model, model_dir)
    return model


def _off_the_file(model: torch.nn.Module) -> None:
    """Copy what stayed dense (embeddings, norms, LM head) out of the checkpoint's memory map. A float32 load maps
    the safetensors file and serves from it; the replaced linears' pages stay resident as long as any tensor keeps
    the map, and the embeddings do."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and type(t.data) is torch.Tensor:  # a tensor-parallel shard is its own copy
                t.data = t.data.clone()
    release_freed_memory()


def _check_no_linear_left_random(model: torch.nn.Module, model_dir: str) -> None:
    """A dense linear that is neither in the files nor replaced would serve transformers' random initialisation."""
    from pathlib import Path

    from safetensors import safe_open

    stored: set[str] = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            stored.update(f.keys())
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and f"{name}.weight" not in stored and not (module is output and tied):
            raise ValueError(f"{model_dir}: `{name}` is neither quantized nor stored in the checkpoint")
