"""`--quantize`: which method a model is served with, decided once at start, and the messages when it cannot be.

The method comes from the flag or, as in TGI, from `config.json`'s `quantization_config.quant_method`. Pre-quantized
checkpoints (gptq, awq, compressed-tensors) are read in their own layout; bitsandbytes / eetq quantize a float
checkpoint at load to int8 weights with int8 activations (W8A8), bitsandbytes-nf4 / -fp4 to 4-bit group-wise
weights (services/shard/quant/loader.py; docs/quantization.md says how the numerics differ from bitsandbytes').
fp8, marlin and exl2 have CUDA kernels only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from libs.runtime import cpu

log = logging.getLogger(__name__)

# TGI's values of --quantize, in its order
METHODS = (
    "awq",
    "compressed-tensors",
    "eetq",
    "exl2",
    "gptq",
    "marlin",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "fp8",
)
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")  # the weights are stored quantized
ON_THE_FLY = {"bitsandbytes": "w8a8", "eetq": "w8a8", "bitsandbytes-nf4": "int4", "bitsandbytes-fp4": "int4"}
CUDA_ONLY = ("fp8", "marlin", "exl2")
NF4_GROUP = 64  # bitsandbytes' 4-bit block size, kept as the group size of the on-the-fly int4 weights

# quant_method spellings in config.json → the --quantize value that serves them
_CONFIG_NAMES = {"fbgemm_fp8": "fp8", "compressed_tensors": "compressed-tensors"}


class QuantizeError(ValueError):
    """A --quantize that cannot run here; the message is for the user."""


def checkpoint_method(model_dir: str | Path) -> str | None:
    """The method `config.json` says its weights are stored in (None: a float checkpoint)."""
    qc = quantization_config(model_dir)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            return f"bitsandbytes-{qc.get('bnb_4bit_quant_type', 'fp4')}"
        return "bitsandbytes"
    return _CONFIG_NAMES.get(method, method) or None


def quantization_config(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    qc = config.get("quantization_config") or config.get("compression_config")
    return qc if isinstance(qc, dict) else None


def resolve(flag: str | None, model_dir: str | Path, cuda: bool | None = None) -> str | None:
    """The method to serve `model_dir` with, or QuantizeError with the reason it cannot run here."""
    if cuda is None:
        cuda = _cuda_available()
    if flag is not None and flag not in METHODS:
        raise QuantizeError(f"--quantize {flag!r} is not a method; TGI's are: {', '.join(METHODS)}")
    stored = checkpoint_method(model_dir)
    where = f"{Path(model_dir) / 'config.json'}"
    if stored is not None and stored not in METHODS:
        raise QuantizeError(f"{where}: unknown quantization_config.quant_method {stored!r}")
    if stored in ON_THE_FLY:  # bitsandbytes' own packed weights: its code books have no CPU kernel here
        raise QuantizeError(
            f"{where}: a checkpoint saved quantized by bitsandbytes ({stored}) is not read here; serve its float "
            f"checkpoint with --quantize {stored}"
        )
    method = flag or stored
    if flag is not None and flag != stored:
        # marlin is a kernel for GPTQ/AWQ checkpoints (TGI accepts it over either); anything else must agree
        if not (flag == "marlin" and stored in ("gptq", "awq")) and (stored is not None or flag in CHECKPOINT_METHODS):
            found = f"quant_method {stored!r}" if stored else "no quantization_config (a float checkpoint)"
            raise QuantizeError(f"Quantization config mismatch: --quantize {flag}, but {where} has {found}")
    if method in CUDA_ONLY and not cuda:
        raise QuantizeError(
            f"--quantize {method} needs a CUDA GPU (its kernels exist for CUDA only) and this machine has none; "
            f"methods that run here: {', '.join(supported_here(cuda=False))}"
        )
    if method and cuda:  # the shard would put the model on the GPU, where the CPU kernels cannot follow
        raise QuantizeError(
            f"--quantize {method} on a machine with CUDA: Switchyard's quantized layers run on the CPU only; the GPU "
            f"kernels (gptq/awq/marlin/fp8/exl2) are not part of it yet"
        )
    if method == "bitsandbytes":
        log.warning("Bitsandbytes 8bit is deprecated, using `eetq` is a drop-in replacement (both are W8A8 here)")
    return method


def supported_here(cuda: bool | None = None) -> list[str]:
    """The --quantize values this machine can serve (none yet where the shard runs on a GPU)."""
    if cuda is None:
        cuda = _cuda_available()
    return [] if cuda else [m for m in METHODS if m not in CUDA_ONLY]


def help_text() -> str:
    """`switchyard serve --help`'s line for --quantize."""
    here = supported_here(cuda=Path("/proc/driver/nvidia/version").exists())  # no torch import for --help
    if not here:
        return "weight quantization: none runs on this machine yet (its CUDA GPU has no quantized kernels here)"
    return (
        "weight quantization; default: config.json's quantization_config. Runs here: "
        + ", ".join(here)
        + " (bitsandbytes/eetq: W8A8 int8 at load; bitsandbytes-nf4/-fp4: int4 group-wise at load)"
        + f"; needs CUDA: {', '.join(CUDA_ONLY)}"
    )


def _cuda_available() -> bool:
    if cpu.torch_cpu_build():
        return False
    import torch

    return torch.cuda.is_available()


def check_shards(method: str | None, model_dir: str | Path, num_shard: int) -> None:
    """QuantizeError where a quantized model cannot be split over `num_shard` tensor-parallel ranks: each rank keeps
    whole groups of a row-parallel layer's inputs (o_proj, down_proj), so the groups must not straddle ranks, and
    GPTQ's desc_act scatters every group over all the inputs."""
    if not method or num_shard <= 1:
        return
    qc = quantization_config(model_dir) or {}
    if method == "gptq" and qc.get("desc_act"):
        raise QuantizeError(
            f"--num-shard {num_shard}: this GPTQ checkpoint has desc_act (each group spread over all of a layer's "
            f"inputs), which cannot be split over ranks; serve it with --num-shard 1"
        )
    group = int(qc.get("group_size") or qc.get("q_group_size") or 0)
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        group = int(((groups[0].get("weights") or {}).get("group_size") or 0) if groups else 0)
    if group <= 0:
        return  # one group a row (or per channel): any split keeps its scale
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    attention = heads * (text.get("head_dim") or text["hidden_size"] // heads) if heads else None
    # the inputs of the row-parallel layers: o_proj's (heads × head_dim) and down_proj's
    for key, k in (("attention width", attention), ("intermediate_size", text.get("intermediate_size"))):
        if isinstance(k, int) and k % (num_shard * group):
            raise QuantizeError(
                f"--num-shard {num_shard}: {key} {k} split over {num_shard} ranks cuts the checkpoint's groups of "
                f"{group} inputs; use a number of shards that divides {k} // {group}"
            )
