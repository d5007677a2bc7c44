"""The decode step's opaque calls as torch custom ops, so that torch.compile traces around them.

Two calls stop a trace: the prepacked oneDNN product (its weight is an mkldnn tensor, which dynamo cannot fake)
and the paged attention (it plans on host arrays and writes the KV pages). Each is registered here with
`torch.library.custom_op` and a fake implementation that only says the output's shape, so dynamo keeps them as
single nodes and inductor fuses the elementwise work between them (services/shard/model/compiled.py).

Neither op takes what it cannot describe: a packed product is named by its index in the running walk's table of
products (`current.products`, built at load in the walk's order, so the same model traces the same graph, in this
process or the next start, and hits inductor's cache), and the attention reads the step's PagedBatch from
`current.paged`. Both are set around each compiled call (`Current.of`), as vLLM's forward context is.
"""

from __future__ import annotations

import contextlib

import torch

from services.shard.attention.paged import PagedBatch, attend_layer
from services.shard.model.onednn import linear as onednn_linear

# (packed weight, bias or None, out_features): one product of a walk's table
Product = tuple[torch.Tensor, torch.Tensor | None, int]


class Current:
    """What the ops read during one compiled call: the walk's products and the step's batch."""

    products: list[Product] | None = None
    paged: PagedBatch | None = None

    @contextlib.contextmanager
    def of(self, products: list[Product], paged: PagedBatch):
        self.products, self.paged = products, paged
        try:
            yield
        finally:
            self.products = self.paged = None


current = Current()


def _product(index: int) -> Product:
    if current.products is None:
        raise RuntimeError("switchyard::onednn_linear called outside a compiled step (ops.current unset)")
    return current.products[index]


@torch.library.custom_op("switchyard::onednn_linear", mutates_args=())
def packed_linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """x [T, in] through the running walk's prepacked product `index`: [T, out]."""
    packed, bias, out_features = _product(index)
    return onednn_linear(x.contiguous(), packed, bias, out_features)


@packed_linear.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _product(index)[2]))


@torch.library.custom_op("switchyard::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float, softcap: float, window: int
) -> torch.Tensor:
    """One layer's paged attention over the current step (q [T, heads, D], k and v [T, kv_heads, D]): the new K/V
    into the pages (a write the compiled graph never reads: only this op does, layer by layer), [T, heads, D] out.
    `softcap` 0: none."""
    if current.paged is None:
        raise RuntimeError("switchyard::paged_attention called outside a compiled step (ops.current unset)")
    out = attend_layer(layer, q, k, v, current.paged, scaling, softcap or None, window)
    return out.contiguous()  # the fake's strides: inductor indexes the output as contiguous


@paged_attention.register_fake
def _(q, k, v, layer, scaling, softcap, window):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
