"""Quantized checkpoints of the tiny test models, written offline in each format's real layout, each with a dense
float32 twin holding exactly the dequantized weights (what transformers runs as the oracle)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.shard.quant import formats as qf

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, gen: torch.Generator):
    """Round-to-nearest; with desc_act the groups are a random scatter of the columns (GPTQ's g_idx)."""
    k = w.shape[1]
    if not desc_act:
        qw = qf.quantize_rtn(w, bits, group, sym)
    else:
        order = torch.randperm(k, generator=gen)  # column order[i] goes to group i // group
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group
        sorted_qw = qf.quantize_rtn(w[:, order], bits, group, sym)
        levels = torch.empty_like(sorted_qw.levels)
        levels[:, order] = sorted_qw.levels
        qw = qf.QuantWeight(levels, sorted_qw.scales, sorted_qw.zeros, bits, group, g_idx)
    qw.scales = qw.scales.half().float()  # checkpoints store fp16 scales: the twin uses the same values
    return qw


def write(src: Path, out: Path, fmt: str, bits=4, group=32, sym=True, desc_act=False, v2=False, seed=0) -> Path:
    """`out`/quant in format `fmt` and `out`/twin; returns `out`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    quant, twin = {}, {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            quant[name] = twin[name] = t
            continue
        qw = quantize(t, bits, group, sym, desc_act, gen)
        if fmt == "compressed-tensors-w8a8":
            qw = qf.quantize_rtn(t, 8, -1, True, act_int8=True)
        twin[name] = qw.dequantize()
        quant.update(_layout(fmt, prefix, qw, bits, v2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(fmt, bits, group, sym, desc_act, v2)
    for folder, weights, cfg in ((out / "quant", quant, config), (out / "twin", twin, None)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg or json.loads((src / "config.json").read_text())))
    return out


def _layout(fmt: str, p: str, qw: qf.QuantWeight, bits: int, v2: bool) -> dict[str, torch.Tensor]:
    n, k = qw.shape
    if fmt == "gptq":
        stored_zeros = qw.zeros.to(torch.int64) if v2 else (qw.zeros.to(torch.int64) - 1) % 2**bits
        g_idx = qw.groups().to(torch.int32)
        return {
            f"{p}.qweight": pack_along_rows(qw.levels.t(), bits),
            f"{p}.qzeros": pack_along_cols(stored_zeros.t(), bits),
            f"{p}.scales": qw.scales.t().half(),
            f"{p}.g_idx": g_idx,
        }
    if fmt == "awq":
        return {
            f"{p}.qweight": awq_pack(qw.levels.t().contiguous()),
            f"{p}.qzeros": awq_pack(qw.zeros.to(torch.uint8).t().contiguous()),
            f"{p}.scales": qw.scales.t().half(),
        }
    if fmt == "compressed-tensors":
        out = {
            f"{p}.weight_packed": pack_along_cols(qw.levels, bits),
            f"{p}.weight_scale": qw.scales.half(),
            f"{p}.weight_shape": torch.tensor([n, k]),
        }
        if not qw.symmetric():
            out[f"{p}.weight_zero_point"] = (qw.zeros - 2 ** (bits - 1)).to(torch.int8)
        return out
    if fmt == "compressed-tensors-w8a8":
        return {f"{p}.weight": (qw.levels.to(torch.int16) - 128).to(torch.int8), f"{p}.weight_scale": qw.scales}
    raise ValueError(fmt)


def _config(fmt: str, bits: int, group: int, sym: bool, desc_act: bool, v2: bool) -> dict:
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "sym": sym,
            "desc_act": desc_act,
            "checkpoint_format": "gptq_v2" if v2 else "gptq",
        }
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    w8a8 = fmt == "compressed-tensors-w8a8"
    weights = {"num_bits": 8 if w8a8 else bits, "type": "int", "symmetric": sym}
    weights.update({"strategy": "channel"} if w8a8 else {"strategy": "group", "group_size": group})
    act = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"} if w8a8 else None
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if w8a8 else "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}},
        "ignore": ["lm_head"],
    }


def awq_pack(levels_kn: torch.Tensor) -> torch.Tensor:
    """[R, C] levels → AWQ's int32 [R, C/8], as AWQ writes its checkpoints."""
    r, c = levels_kn.shape
    ordered = levels_kn.view(r, c // 8, 8)[:, :, list(qf.AWQ_ORDER)].reshape(r, c)
    return pack_along_cols(ordered, 4)


def pack_along_cols(levels: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_along_rows(levels.t(), bits).t().contiguous()


def pack_along_rows(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of formats.unpack_along_rows: levels packed into int32 words along the rows."""
    per = 32 // bits
    u = levels.to(torch.int64).reshape(-1, per, levels.shape[1])
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    words = (u << shifts).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
