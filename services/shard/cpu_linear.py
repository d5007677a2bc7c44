"""The model's linear layers through oneDNN with prepacked weights, on CPU.

torch's CPU `linear` calls MKL's sgemm. On the AMD machines this project is measured on, MKL runs the small-M
products of a decode step (M = batch size) well below memory bandwidth, and the LM head — the biggest matrix of
a small model (Gemma-3-270M: 168M of its 268M parameters) — worst of all; oneDNN with the weight reordered once
into its blocked layout does the same products 1.5–2.5× faster there (`python -m launcher.bench.linear`). The
numbers differ from MKL's only in float rounding (summation order), as MKL's own differ between batch sizes.

Only plain float32 `nn.Linear` modules on CPU are switched; tensor-parallel shards (DTensor weights) and other
dtypes keep torch's path. The original weights stay (a tied embedding reads them); the packed copies cost the
linear weights' size once more in memory.
"""

from __future__ import annotations

import torch

# Batch size the weights are reordered for; oneDNN serves any M from the same packing.
PACK_FOR_BATCH = 64


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn(model: torch.nn.Module) -> int:
    """Switch the model's eligible linear layers to oneDNN; returns how many were switched."""
    if not available():
        return 0
    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is not torch.nn.Linear or type(weight.data) is not torch.Tensor:
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_BATCH)
        module.forward = _packed_forward(packed, module.bias, module.out_features)
        switched += 1
    return switched


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [None], "")
        return y.view(*x.shape[:-1], out_features)

    return forward
