"""Quantized checkpoint tensors → one canonical form (`QuantWeight`), and round-to-nearest quantization of float
weights into it.

Every format here stores a linear weight W [out N, in K] as integer levels u with per-group scales s and zero
points z, and W[n, k] = (u[n, k] − z[n, g(k)]) · s[n, g(k)], where g(k) is the group of input column k (k // group
size, or GPTQ's `g_idx` when `desc_act` reordered the columns). The formats differ only in how u and z are packed:
each `from_*` function's docstring gives its layout. The canonical form keeps u as uint8 in [0, 2^b) and z in the
same unsigned domain (signed formats shift both by 2^(b−1)), so every kernel in services/shard/quant/layers.py reads
one layout. docs/quantization.md tells the design.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8


@dataclass
class QuantWeight:
    levels: torch.Tensor  # uint8 [N, K], in [0, 2**bits)
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor  # float32 [N, G], integer-valued, same domain as levels
    bits: int
    group_size: int  # K when the whole row is one group
    g_idx: torch.Tensor | None = None  # int64 [K]; None: column k is in group k // group_size
    act_int8: bool = False  # activations quantized per token to int8 at run time (W8A8)
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.levels.shape)

    def groups(self) -> torch.Tensor:
        """The group of each input column."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.levels.shape[1]) // self.group_size

    def symmetric(self) -> bool:
        return bool((self.zeros == 2 ** (self.bits - 1)).all())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these levels stand for, in the checkpoint's column order."""
        g = self.groups()
        return (self.levels.float() - self.zeros[:, g]) * self.scales[:, g]


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C], 32/bits levels a word (level j at bits j·bits) packed along rows → uint8 [R·32/bits, C]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    words = packed.to(torch.int32).unsqueeze(1)  # [R, 1, C]
    levels = (words >> shifts.view(1, per, 1)) & (2**bits - 1)
    return levels.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_along_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_along_rows(packed.t(), bits).t().contiguous()


def _group_size(k: int, n_groups: int) -> int:
    return k // n_groups


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    checkpoint_format: str = "gptq",
    bias: torch.Tensor | None = None,
) -> QuantWeight:
    """GPTQ: `qweight` int32 [K·b/32, N] packs b-bit levels along K (level j of a word at bits j·b); `qzeros` int32
    [G, N·b/32] packs along N; `scales` [G, N]; `g_idx` [K]. The original format (`checkpoint_format` "gptq")
    stores z − 1 (a bug of the first GPTQ kernels kept for compatibility); "gptq_v2" stores z."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported here (4 and 8 are)")
    levels = unpack_along_rows(qweight, bits).t().contiguous()  # [N, K]
    zeros = unpack_along_cols(qzeros, bits).t().float()  # [N, G]
    if checkpoint_format != "gptq_v2":
        zeros = (zeros + 1) % 2**bits  # v1 stores z − 1 (and a z of 0 wraps to the top level)
    n, k = levels.shape
    zeros = zeros[:n]
    group_size = _group_size(k, scales.shape[0])
    groups = None
    if g_idx is not None:
        g = g_idx.to(torch.int64)
        if not torch.equal(g, torch.arange(k) // group_size):
            groups = g
    return QuantWeight(levels, scales.t().float().contiguous(), zeros.contiguous(), bits, group_size, groups, bias=bias)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> QuantWeight:
    """AWQ (GEMM): `qweight` int32 [K, N/8] packs 4-bit levels along N in the interleaved order AWQ_ORDER;
    `qzeros` [G, N/8] the same way; `scales` [G, N]. Always asymmetric."""
    reverse = torch.tensor([AWQ_ORDER.index(i) for i in range(8)])

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [R, C/8] → [R, C], undoing the interleave
        cols = unpack_along_cols(packed, 4)  # nibble order
        r, c = cols.shape
        return cols.view(r, c // 8, 8)[:, :, reverse].reshape(r, c)

    levels = unpack(qweight).t().contiguous()  # [N, K]
    zeros = unpack(qzeros).t().float().contiguous()  # [N, G]
    k = levels.shape[1]
    return QuantWeight(levels, scales.t().float().contiguous(), zeros, 4, _group_size(k, scales.shape[0]), bias=bias)


def from_compressed_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | None,
    bits: int,
    weight_zero_point: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> QuantWeight:
    """compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K·b/32] packs along K; levels are signed and
    stored plus 2^(b−1); `weight_scale` [N, G]; `weight_zero_point` [N, G] (signed) when asymmetric."""
    offset = 2 ** (bits - 1)
    levels = unpack_along_cols(weight_packed, bits)  # [N, K'] (stored as signed + offset)
    if weight_shape is not None:
        n, k = (int(v) for v in weight_shape.tolist())
        levels = levels[:n, :k].contiguous()
    scales = weight_scale.float().reshape(levels.shape[0], -1)
    zp = torch.zeros_like(scales) if weight_zero_point is None else weight_zero_point.float().reshape(scales.shape)
    group_size = _group_size(levels.shape[1], scales.shape[1])
    return QuantWeight(levels, scales.contiguous(), (zp + offset).contiguous(), bits, group_size, bias=bias)


def from_compressed_int8(
    weight: torch.Tensor, weight_scale: torch.Tensor, act_int8: bool, bias: torch.Tensor | None = None
) -> QuantWeight:
    """compressed-tensors `int-quantized`: `weight` int8 [N, K] and `weight_scale` [N, 1]; activations quantized per
    token at run time (`act_int8`)."""
    levels = (weight.to(torch.int16) + 128).to(torch.uint8)
    scales = weight_scale.float().reshape(weight.shape[0], -1).contiguous()
    zeros = torch.full_like(scales, 128.0)
    return QuantWeight(
        levels, scales, zeros, 8, _group_size(weight.shape[1], scales.shape[1]), act_int8=act_int8, bias=bias
    )


def quantize_rtn(
    weight: torch.Tensor,
    bits: int,
    group_size: int = -1,
    symmetric: bool = True,
    act_int8: bool = False,
    bias: torch.Tensor | None = None,
) -> QuantWeight:
    """Round-to-nearest quantization of a float weight [N, K]: what `--quantize bitsandbytes*`/`eetq` do at load,
    and how the tests build their checkpoints. Symmetric: z = 2^(b−1), s = absmax / (2^(b−1) − 1); asymmetric:
    the group's [min, max] spans all 2^b levels."""
    w = weight.detach().float()
    n, k = w.shape
    gs = k if group_size in (-1, 0) else group_size
    if k % gs:
        raise ValueError(f"in_features {k} is not a multiple of the group size {gs}")
    grouped = w.view(n, k // gs, gs)
    top = 2**bits - 1
    if symmetric:
        scales = (grouped.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp_min(1e-8)
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        lo, hi = grouped.amin(-1).clamp_max(0), grouped.amax(-1).clamp_min(0)
        scales = ((hi - lo) / top).clamp_min(1e-8)
        zeros = (-lo / scales).round().clamp(0, top)
    levels = (grouped / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, top)
    return QuantWeight(levels.view(n, k).to(torch.uint8), scales, zeros, bits, gs, act_int8=act_int8, bias=bias)


def read_checkpoint(model_dir: str, method: str, qconfig: dict) -> dict[str, QuantWeight]:
    """Every quantized linear of a checkpoint folder, by module name (`model.layers.0.self_attn.q_proj`)."""
    from pathlib import Path

    from safetensors import safe_open

    files = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update({key: path for key in f.keys()})

    def get(key: str) -> torch.Tensor | None:
        if key not in files:
            return None
        with safe_open(str(files[key]), framework="pt") as f:
            return f.get_tensor(key)

    out: dict[str, QuantWeight] = {}
    if method == "gptq":
        bits, fmt = int(qconfig.get("bits", 4)), qconfig.get("checkpoint_format", "gptq")
        for key in files:
            if key.endswith(".qweight"):
                p = key[: -len(".qweight")]
                out[p] = from_gptq(
                    get(key), get(f"{p}.qzeros"), get(f"{p}.scales"), get(f"{p}.g_idx"), bits, fmt, get(f"{p}.bias")
                )
    elif method == "awq":
        if int(qconfig.get("bits", 4)) != 4 or str(qconfig.get("version", "gemm")).lower() != "gemm":
            raise ValueError("AWQ: only the 4-bit GEMM layout is supported")
        for key in files:
            if key.endswith(".qweight"):
                p = key[: -len(".qweight")]
                out[p] = from_awq(get(key), get(f"{p}.qzeros"), get(f"{p}.scales"), get(f"{p}.bias"))
    elif method == "compressed-tensors":
        groups = list((qconfig.get("config_groups") or {}).values())
        weights = (groups[0].get("weights") or {}) if groups else {}
        act = (groups[0].get("input_activations") or {}) if groups else {}
        bits = int(weights.get("num_bits", 8))
        for key in files:
            if key.endswith(".weight_packed"):
                p = key[: -len(".weight_packed")]
                out[p] = from_compressed_packed(
                    get(key), get(f"{p}.weight_scale"), get(f"{p}.weight_shape"), bits,
                    get(f"{p}.weight_zero_point"), get(f"{p}.bias"),
                )  # fmt: skip
            elif key.endswith(".weight_scale") and key.removesuffix("_scale") in files:  # an int8 `weight` beside it
                p = key.removesuffix(".weight_scale")
                weight = get(f"{p}.weight")
                if weight.dtype == torch.int8:
                    dynamic_int8 = bool(act) and act.get("dynamic", False) and int(act.get("num_bits", 8)) == 8
                    out[p] = from_compressed_int8(weight, get(key), dynamic_int8, get(f"{p}.bias"))
    else:
        raise ValueError(f"{method} checkpoints are not read here")
    return out


def shard_for_rank(qw: QuantWeight, split: str, offset: int, size: int) -> QuantWeight:
    """This rank's part of a whole quantized weight under tensor parallelism, its scales and zeros split with it:
    "col" keeps output rows [offset, offset + size) (and their bias); "row" keeps those input columns and the groups
    they make up (the bias stays whole: transformers adds it once, after the ranks' partial products are summed)."""
    if split == "col":
        rows = slice(offset, offset + size)
        bias = None if qw.bias is None else qw.bias[rows].contiguous()
        return QuantWeight(qw.levels[rows].contiguous(), qw.scales[rows].contiguous(), qw.zeros[rows].contiguous(),
                           qw.bits, qw.group_size, qw.g_idx, qw.act_int8, bias)  # fmt: skip
    k = qw.levels.shape[1]
    if qw.g_idx is not None:  # desc_act scatters every group over all columns: no rank holds whole groups
        raise ValueError("a GPTQ checkpoint with desc_act (g_idx) cannot be split by input columns over ranks; "
                         "serve it with --num-shard 1")  # fmt: skip
    if qw.group_size == k:  # one group a row: every rank's slice keeps the row's scale
        scales, zeros, group = qw.scales, qw.zeros, size
    elif offset % qw.group_size or size % qw.group_size:
        raise ValueError(f"input columns [{offset}, {offset + size}) of this rank cut groups of {qw.group_size}: "
                         f"the number of shards must split the layer's {k} inputs at group boundaries")  # fmt: skip
    else:
        kept = slice(offset // qw.group_size, (offset + size) // qw.group_size)
        scales, zeros, group = qw.scales[:, kept], qw.zeros[:, kept], qw.group_size
    return QuantWeight(qw.levels[:, offset : offset + size].contiguous(), scales.contiguous(), zeros.contiguous(),
                       qw.bits, group, None, qw.act_int8, qw.bias)  # fmt: skip
