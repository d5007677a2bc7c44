"""Quantized linear layers on CPU, on torch's own kernels, behind nn.Linear's forward.

- `W8A8Linear`: int8 weights per output channel, activations quantized per token (row) to int8 at run time, the
  product in `torch._int_mm` (int32 accumulation: VNNI / AMX-INT8), at every batch size.
- `Int4Linear`: 4-bit weights, group-wise scales and zero points, `_weight_int4pack_mm_for_cpu`.
- `Int8Linear`: 8-bit weight-only, symmetric per channel, `_weight_int8pack_mm`.
- `DequantLinear`: any other layout (8-bit with groups or zero points, odd group sizes); dequantizes per call.
Weight-only kernels cost more with every row (steeply with float32 activations): from `dense_from[dtype]` rows on, a
layer dequantizes into one scratch buffer shared by every layer (they run one after another in one thread) and runs
one dense product, so prefill stays near dense speed with only the quantized weights resident. Each layer computes
in its input's dtype: float32 stays exact against the dequantized weights. docs/quantization.md tells why.
"""

from __future__ import annotations

import torch

from services.shard.model.onednn import SharedInputProduct
from services.shard.quant.formats import QuantWeight

# Rows from which a weight-only layer dequantizes and runs a dense product, by activation dtype (where the dense
# product overtakes the kernel; int4's unpacking costs more than int8's, so its kernel keeps more rows)
INT4_DENSE_FROM = {torch.bfloat16: 512, torch.float16: 512, torch.float32: 4}
INT8_DENSE_FROM = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 4}
INT4_GROUPS = (256, 128, 64, 32)  # group sizes the CPU int4 kernel takes
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _SCRATCH.get(dtype)
    # a buffer made under inference mode cannot be written outside it (a runner's step vs a test's or bench's call)
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < n * k:
        buf = _SCRATCH[dtype] = torch.empty(n * k, dtype=dtype)
    return buf[: n * k].view(n, k)


def _group_order(qw: QuantWeight) -> tuple[torch.Tensor | None, QuantWeight]:
    """With GPTQ's desc_act the groups are scattered over the columns: sort the columns by group so each group is
    contiguous (the input is permuted the same way at run time)."""
    if qw.g_idx is None:
        return None, qw
    n_groups = qw.scales.shape[1]
    counts = torch.bincount(qw.g_idx, minlength=n_groups)
    if not bool((counts == counts[0]).all()):
        raise ValueError("g_idx groups of unequal size")
    perm = torch.argsort(qw.g_idx, stable=True)
    k = qw.levels.shape[1]
    sorted_qw = QuantWeight(
        qw.levels[:, perm].contiguous(), qw.scales, qw.zeros, qw.bits, k // n_groups, None, qw.act_int8, qw.bias
    )
    return perm, sorted_qw


class QuantLinear(torch.nn.Linear):
    """A linear layer to whoever asks (isinstance: LoRA targets it), without nn.Linear's float weight."""

    dense_from: dict[torch.dtype, int] = {}  # rows from which the dense scratch product runs (absent: never)

    def __init__(self, qw: QuantWeight, dense_from_rows: int | None = None):
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate the float weight
        # the sizes this module computes; in/out_features are the whole layer's (differ under tensor parallelism)
        self.out_features, self.in_features = self.local_out, self.local_in = qw.shape
        self.bits = qw.bits
        if dense_from_rows is not None:  # one threshold for every dtype (tests, benchmarks)
            self.dense_from = dict.fromkeys((torch.float32, torch.bfloat16, torch.float16), dense_from_rows)
        self.perm, qw = _group_order(qw)
        bias = None if qw.bias is None else torch.nn.Parameter(qw.bias.detach().float(), requires_grad=False)
        self.register_parameter("bias", bias)  # a parameter: transformers' row-parallel forward hides it

    weight_dtype = torch.float32  # the dtype of the dense layer it replaced (replace_linears sets it)
    tensor_parallel = False  # this rank's share of a layer split over ranks (its forward is transformers')

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in for code that reads a linear's weight shape, dtype and device (LoRA sizes and places its A/B
        by them): the right shape, no memory (one broadcast zero)."""
        return torch.zeros((), dtype=self.weight_dtype).expand(self.local_out, self.local_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.local_in)
        if self.perm is not None:
            flat = flat.index_select(-1, self.perm)
        if flat.shape[0] >= self.dense_from.get(flat.dtype, 1 << 62):
            w = self.dequantize_into(_scratch(self.local_out, self.local_in, flat.dtype))
            y = torch.mm(flat, w.t())
        else:
            y = self.product(flat)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.local_out)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """The weight [N, K] in the layer's (group-sorted) column order, written into `out`."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.local_in}, out_features={self.local_out}, bits={self.bits}"


class Int4Linear(QuantLinear):
    dense_from = INT4_DENSE_FROM

    def __init__(self, qw: QuantWeight, dense_from_rows: int | None = None):
        super().__init__(qw, dense_from_rows)
        _, qw = _group_order(qw)
        kgroup = next((g for g in INT4_GROUPS if qw.group_size % g == 0), None)
        if qw.bits != 4 or kgroup is None or self.in_features % 2:
            raise ValueError(f"no int4 kernel for bits={qw.bits}, group size {qw.group_size}")
        reps = qw.group_size // kgroup  # a larger group is several kernel groups with the same scale and zero
        scales = qw.scales.repeat_interleave(reps, 1)
        zeros = qw.zeros.repeat_interleave(reps, 1)
        self.kgroup = kgroup
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.levels.to(torch.int32), 1)
        # the kernel computes (u − 8)·s + m per group; (u − z)·s = (u − 8)·s + (8 − z)·s
        self.scales_zeros = torch.stack([scales, (8 - zeros) * scales], -1).transpose(0, 1).contiguous()
        # [N, K/kgroup] views of the same floats for the scratch dequantization (no second copy resident)
        self._group_scales, self._group_offsets = self.scales_zeros.transpose(0, 1).unbind(-1)
        self.pack_block = reads_int4pack(self.packed, qw.levels)
        self.plain = None if self.pack_block else _nibbles(qw.levels)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.kgroup, self.scales_zeros.to(flat.dtype)
        )

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        levels = _unpack_int4pack(self.packed, self.pack_block) if self.plain is None else _unnibble(self.plain)
        n, k = out.shape
        grouped = out.view(n, k // self.kgroup, self.kgroup)
        grouped.copy_(levels.view(n, k // self.kgroup, self.kgroup))
        grouped.sub_(8).mul_(self._group_scales.unsqueeze(-1).to(out.dtype))
        grouped.add_(self._group_offsets.unsqueeze(-1).to(out.dtype))
        return out


# Output channels per block of torch's CPU int4 packing: 64 where its kernel is built for AVX-512, 32 for AVX2.
INT4PACK_BLOCKS = (64, 32)


def _unpack_int4pack(packed: torch.Tensor, block: int) -> torch.Tensor:
    """uint8 levels [N, K] from the CPU int4 packing: per block of `block` output channels and per k, block/2 bytes,
    byte n % (block/2), low nibble for n % block < block/2. Checked against torch's packing at every layer build."""
    n, half = packed.shape
    k, b2 = half * 2, block // 2
    nib = torch.stack([packed & 15, packed >> 4], 0).view(2, n // block, k, b2)
    return nib.permute(1, 0, 3, 2).reshape(n, k)


def reads_int4pack(packed: torch.Tensor, levels: torch.Tensor) -> int | None:
    """The block size with which _unpack_int4pack reads this torch's int4 packing on this CPU, or None (then the
    layer keeps its own copy of the levels)."""
    if packed.shape != (levels.shape[0], levels.shape[1] // 2):
        return None
    for block in INT4PACK_BLOCKS:
        if packed.shape[0] % block == 0 and torch.equal(_unpack_int4pack(packed, block), levels):
            return block
    return None


def _nibbles(levels: torch.Tensor) -> torch.Tensor:
    return (levels[:, ::2] | (levels[:, 1::2] << 4)).contiguous()


def _unnibble(plain: torch.Tensor) -> torch.Tensor:
    return torch.stack([plain & 15, plain >> 4], -1).view(plain.shape[0], -1)


class Int8Linear(QuantLinear):
    dense_from = INT8_DENSE_FROM

    def __init__(self, qw: QuantWeight, dense_from_rows: int | None = None):
        super().__init__(qw, dense_from_rows)
        _, qw = _group_order(qw)
        if qw.bits != 8 or qw.scales.shape[1] != 1 or not qw.symmetric():
            raise ValueError("the int8 weight-only kernel takes symmetric per-channel weights")
        self.weight_int8 = (qw.levels.to(torch.int16) - 128).to(torch.int8)
        self.channel_scales = qw.scales[:, 0].contiguous()

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.channel_scales.to(flat.dtype))

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self.weight_int8)
        return out.mul_(self.channel_scales.unsqueeze(1).to(out.dtype))


class W8A8Linear(QuantLinear):
    """y = (s_x · s_w) ⊙ (q_x · q_wᵀ), q_x = round(x / s_x) per row with s_x = max|x_row| / 127.

    The int8 weights stay [N, K] (nn.Linear's layout) and go to `torch._int_mm` as the transposed view: a
    column-major right operand, faster than a [K, N] copy at one row and as fast at larger steps, so one layout
    serves every step shape (docs/quantization.md)."""

    kernel = "_int_mm, column-major int8 weights"  # what `product` runs (tests check it fired)

    def __init__(self, qw: QuantWeight):
        super().__init__(qw)  # no dense_from: activations are quantized at every size, the numerics stay one thing
        _, qw = _group_order(qw)
        if qw.bits != 8 or qw.scales.shape[1] != 1 or not qw.symmetric():
            raise ValueError("W8A8 takes symmetric per-channel int8 weights")
        self.weight_int8 = (qw.levels.to(torch.int16) - 128).to(torch.int8).contiguous()  # [N, K]
        self.channel_scales = qw.scales[:, 0].contiguous()

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return w8a8_product(flat, self.weight_int8, self.channel_scales)

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self.weight_int8)
        return out.mul_(self.channel_scales.unsqueeze(1).to(out.dtype))


def w8a8_product(flat: torch.Tensor, weight_int8: torch.Tensor, channel_scales: torch.Tensor) -> torch.Tensor:
    """[M, K] activations quantized per row, one int8 product with the [N, K] weights, scaled back in place."""
    x = flat.float()  # `flat` itself when it is float32: not written to
    row_scales = x.abs().amax(-1, keepdim=True).div_(127).clamp_min_(1e-12)
    # |x / s| <= 127 by construction of s (round never passes 127): no clamp
    q = (x / row_scales).round_().to(torch.int8)
    acc = torch._int_mm(q, weight_int8.t()).float()
    return acc.mul_(row_scales).mul_(channel_scales).to(flat.dtype)


class FusedW8A8(SharedInputProduct):
    """Sibling W8A8 layers that read the same input (q/k/v, gate/up) as one product: the activations quantized once,
    one `_int_mm` over the weights stacked ([q; k; v], rows). Every output element is the same int32 dot product
    scaled by the same two scales, so each member's columns equal its own product bit for bit (tested). The members
    keep nn.Linear's call and share the product as services/shard/model/onednn.py's fused oneDNN products do."""

    kernel = W8A8Linear.kernel

    def __init__(self, members: list[W8A8Linear]):
        super().__init__([m.local_out for m in members])
        self.weight_int8 = torch.cat([m.weight_int8 for m in members]).contiguous()
        self.channel_scales = torch.cat([m.channel_scales for m in members])
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        for m, (start, end) in zip(members, self.columns):
            m.weight_int8 = self.weight_int8[start:end]  # a view: the members' own copies go
            m.channel_scales = self.channel_scales[start:end]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        y = w8a8_product(x.reshape(-1, x.shape[-1]), self.weight_int8, self.channel_scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], -1)


def fuse_w8a8(model: torch.nn.Module, groups: tuple[tuple[str, ...], ...]) -> int:
    """Fuse each group of sibling W8A8 layers (same input width, no input permutation, biases alike, not split by
    tensor parallelism); returns how many layers now share a product."""
    fused = 0
    for parent in model.modules():
        for names in groups:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is W8A8Linear and m.perm is None and not m.tensor_parallel for m in members):
                continue
            if len({(m.local_in, m.bias is None) for m in members}) != 1:
                continue
            product = FusedW8A8(members)
            for i, m in enumerate(members):
                m.forward = lambda x, i=i, product=product: product.columns_for(i, x)
                m.fused_product = product  # for tests: which group it belongs to
            fused += len(members)
    return fused


class DequantLinear(QuantLinear):
    """Any layout: the levels stay resident (one byte each) and the weight is rebuilt for every call."""

    def __init__(self, qw: QuantWeight):
        super().__init__(qw, dense_from_rows=0)
        _, qw = _group_order(qw)
        self.levels, self.scales, self.zeros, self.group_size = qw.levels, qw.scales, qw.zeros, qw.group_size

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        n, k = out.shape
        grouped = out.view(n, k // self.group_size, self.group_size)
        grouped.copy_(self.levels.view(n, -1, self.group_size))
        grouped.sub_(self.zeros.unsqueeze(-1).to(out.dtype)).mul_(self.scales.unsqueeze(-1).to(out.dtype))
        return out


def build(qw: QuantWeight, dense_from_rows: int | None = None) -> QuantLinear:
    """The fastest module that computes exactly this layout."""
    per_channel_sym = qw.bits == 8 and qw.scales.shape[1] == 1 and qw.symmetric()
    if qw.act_int8:
        if not per_channel_sym:
            raise ValueError("W8A8 needs symmetric per-channel int8 weights")
        return W8A8Linear(qw)
    try:
        if qw.bits == 4:
            return Int4Linear(qw, dense_from_rows)
        if per_channel_sym:
            return Int8Linear(qw, dense_from_rows)
    except (ValueError, RuntimeError):
        pass  # a shape the kernel refuses: the generic path below computes the same weights
    return DequantLinear(qw)
