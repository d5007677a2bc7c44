"""The model's linear layers through oneDNN with prepacked weights, on CPU; projections that read the same input
fused into one product.

`use_onednn` gives each plain CPU `nn.Linear` a forward that runs oneDNN on its weight reordered once into the
blocked layout; results differ from torch's only in float rounding (summation order). q/k/v, and gate/up, read the
same hidden states: one product over their stacked weights serves the group, bit for bit the separate products
(tested); the first member called with an input computes it, the others take their column slice while they are
called with that same tensor object (another input: computed again). float32 always; bfloat16 where a probe product
on this CPU runs and matches (else, and for other dtypes and tensor-parallel DTensor weights, torch's path stays).
The original weights stay (a tied embedding reads them): the packed copies cost the linears' size once more.
docs/attention.md tells why oneDNN and not torch's own path.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Batch size the weights are reordered for; oneDNN serves any M from the same packing.
PACK_FOR_BATCH = 64

# Sibling projections (attributes of one module) that read the same input, in the order the models call them.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# dtypes oneDNN is asked to take; each is probed once (dtype_supported)
CANDIDATE_DTYPES = (torch.float32, torch.bfloat16)
_supported: dict[torch.dtype, bool] = {}


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def dtype_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs `dtype` linears on this CPU: tried once on a small product, then remembered."""
    if dtype not in CANDIDATE_DTYPES or not available():
        return False
    if dtype not in _supported:
        gen = torch.Generator().manual_seed(0)
        weight, x = torch.randn(32, 64, generator=gen).to(dtype), torch.randn(2, 64, generator=gen).to(dtype)
        try:
            got = linear(x, pack(weight), None, 32)
            ok = got.dtype == dtype and torch.allclose(got.float(), (x.float() @ weight.float().T), 5e-2, 5e-2)
            why = "" if ok else "its product does not match"
        except RuntimeError as e:  # "bf16 path needs the cpu support avx512bw, avx512vl and avx512dq", ...
            ok, why = False, str(e).splitlines()[0]
        _supported[dtype] = ok
        if not ok:
            log.warning("oneDNN cannot run %s linears on this CPU (%s): they keep torch's path", dtype, why)
    return _supported[dtype]


def _eligible(module) -> bool:
    weight = getattr(module, "weight", None)
    if type(module) is not torch.nn.Linear or type(weight.data) is not torch.Tensor:
        return False
    return weight.device.type == "cpu" and dtype_supported(weight.dtype)


def use_onednn(model: torch.nn.Module, fuse: bool = True) -> int:
    """Switch the model's eligible linear layers to oneDNN (fusing sibling projections unless `fuse` is off);
    returns how many linear modules were switched."""
    if not available():
        return 0
    switched: set[int] = set()
    if fuse:
        for parent in model.modules():
            for names in FUSED_GROUPS:
                members = [getattr(parent, name, None) for name in names]
                if not all(_eligible(m) for m in members) or any(id(m) in switched for m in members):
                    continue
                if len({(m.in_features, m.weight.dtype, m.bias is None) for m in members}) != 1:
                    continue
                _fuse(members)
                switched.update(id(m) for m in members)
    for module in model.modules():
        if id(module) in switched or not _eligible(module):
            continue
        packed = pack(module.weight)
        module.forward = _packed_forward(packed, module.bias, module.out_features)
        module.onednn_packed = True  # LoRA folds its shrink into such a product (services/shard/lora/fold.py)
        module.onednn_weight = (packed, module.bias, module.out_features)  # the compiled walk's custom op reads it
        switched.add(id(module))
    return len(switched)


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_BATCH)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    if x.dim() == 2:  # the decoder walk's [tokens, in]: no reshape and view around it (per-op Python, every linear)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [None], "")
    return y.view(*x.shape[:-1], out_features)


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, packed, bias, out_features)

    return forward


class SharedInputProduct:
    """One product for sibling projections that read the same input: the first member called with an input computes
    the whole output, each member takes its columns, and the activations go once every member has its part.
    Subclasses say how the whole product is computed (`product`)."""

    def __init__(self, widths: list[int]):
        bounds = [0]
        for width in widths:
            bounds.append(bounds[-1] + width)
        self.columns = list(zip(bounds[:-1], bounds[1:]))
        self.input: torch.Tensor | None = None  # the tensor `output` was computed from (held, so never a new id)
        self.output: torch.Tensor | None = None
        self.unserved: set[int] = set()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def columns_for(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self.input or member not in self.unserved:
            self.input, self.output = x, self.product(x)
            self.unserved = set(range(len(self.columns)))
        start, end = self.columns[member]
        out = self.output[..., start:end]
        self.unserved.discard(member)
        if not self.unserved:  # every member has its part: let the activations go
            self.input = self.output = None
        return out


class _FusedProduct(SharedInputProduct):
    """One stacked oneDNN product for a group of projections."""

    def __init__(self, members: list[torch.nn.Linear]):
        super().__init__([m.out_features for m in members])
        weight = torch.cat([m.weight.detach() for m in members])
        bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self.packed, self.bias, self.out_features = pack(weight), bias, weight.shape[0]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias, self.out_features)


def _fuse(members: list[torch.nn.Linear]) -> None:
    product = _FusedProduct(members)
    for i, module in enumerate(members):
        module.forward = lambda x, i=i: product.columns_for(i, x)
        module.fused_product = product  # which group it belongs to (tests, and LoRA's folded products)
        module.fused_member = i
