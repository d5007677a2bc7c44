"""The stacked form's shrink folded into the base model's own oneDNN product, and in bf16 a family's expands into one.

Where a family's base product (q/k/v, gate/up, or one linear alone) is services/shard/model/onednn.py's packed one,
the family gets a second packed weight, [W; A]: the base weights with every adapter's A stacked under them. One
product then gives the base output and the shrink (the first columns equal the base product bit for bit, tested),
the mask keeps each token's own adapter's columns, and one expand against B laid out block-diagonally ([C, out])
adds every member's delta; in float32, and for a lone linear, each member expands against its own block instead.
The plain packing stays for steps without adapter rows, so adapted linears are packed twice, rebuilt at every load
and unload. Used only where it applies exactly: every member a packed oneDNN linear (a whole fused group, or a lone
packed linear), unsharded, in the adapters' dtype; anything else (tensor parallel, quantized layers, float32
adapters over a bf16 model, q/v adapted but not k) keeps registry.py's products. docs/lora.md tells why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.shard.lora.products import RowGroups, Stack
from services.shard.model.onednn import SharedInputProduct, linear, pack


def group_of(layers, dtype: torch.dtype) -> list | None:
    """The family's modules in the order of their packed product (a fused group's order, or the one linear), when
    `layers` (registry.py's LoraLayer) are exactly that product's members and can fold (adapters in `dtype`, the
    weights'); else None."""
    modules = [layer.module for layer in layers]
    if any(layer.split is not None for layer in layers) or modules[0].weight.dtype != dtype:
        return None
    product = getattr(modules[0], "fused_product", None)
    if product is None:
        return modules if len(modules) == 1 and getattr(modules[0], "onednn_packed", False) else None
    if len(product.columns) != len(modules) or any(getattr(m, "fused_product", None) is not product for m in modules):
        return None  # part of a fused group adapted (q and v, not k): its other members would compute it again
    return sorted(modules, key=lambda m: m.fused_member)


def per_member_expands(dtype: torch.dtype) -> bool:
    """Whether a family's expand runs one product per member (float32) or one block-diagonal product (FoldedProduct)."""
    return dtype == torch.float32


class FoldedProduct(SharedInputProduct):
    """[W; A] packed for one family and its expands (B per member, or block-diagonal in bf16); the step's output is
    shared by the members as onednn.py's fused product shares its own (`columns_for(member, x)`, member = index
    in `modules`)."""

    def __init__(
        self,
        modules: list[torch.nn.Linear],
        stack: Stack,
        columns: dict[int, tuple],
        step_groups: Callable[[], RowGroups],
    ) -> None:
        """`columns`: id(module) → that member's (c0, c1, B.T) in the stack's columns (registry.py's stacked_columns);
        `step_groups`: the registry's grouping of the step being run."""
        super().__init__([m.out_features for m in modules])
        weights = [m.weight.detach() for m in modules]
        width = sum(w.shape[0] for w in weights)
        c = stack.a.shape[0]
        self.packed = pack(torch.cat([*weights, stack.a]))
        bias = modules[0].bias
        self.bias = None if bias is None else torch.cat([m.bias.detach() for m in modules] + [bias.new_zeros(c)])
        self.base_width, self.width, self.stack, self.step_groups = width, width + c, stack, step_groups
        # The expand (module docstring): per member against its own block of B in float32, and for a lone
        # linear, whose block is all of B; else one product against B block-diagonal ([C, out]).
        blocks = []
        for m, (start, end) in zip(modules, self.columns):
            c0, c1, b_t = columns[id(m)]
            blocks.append((c0, c1, start, end, b_t))
        if len(modules) == 1 or per_member_expands(weights[0].dtype):
            self.expands = blocks
        else:
            expand_t = weights[0].new_zeros(c, width)
            for c0, c1, start, end, b_t in blocks:
                expand_t[c0:c1, start:end] = b_t
            self.expands = [(0, c, 0, width, expand_t)]
        # one expand (a lone linear's, or the block-diagonal one) covers every column of y and of the shrink
        self.whole = self.expands[0][4] if len(self.expands) == 1 else None
        self.member = {id(m): i for i, m in enumerate(modules)}
        self.calls = 0  # folded products computed (tests: the fold fired)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        # Called for every adapted family of every layer at each step: every tensor op here costs its Python and
        # dispatch whatever its size, so 2-D inputs (the decoder walk's) skip the reshape and view, and one expand
        # over every column adds into the output without slicing it.
        groups = self.step_groups()
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        groups.check(flat)
        z = linear(flat, self.packed, self.bias, self.width)  # flat is 2-D: no reshape around the product
        y, shrunk = z[:, : self.base_width], z[:, self.base_width :]
        shrunk.mul_(groups.mask(self.stack.layout, self.stack.column_slots, shrunk.dtype))
        # base tokens' masked columns are exact zeros: their rows stay the base's
        if self.whole is not None:
            y.addmm_(shrunk, self.whole)
        else:
            for c0, c1, start, end, b_t in self.expands:
                y[:, start:end].addmm_(shrunk[:, c0:c1], b_t)
        self.calls += 1
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.base_width)
