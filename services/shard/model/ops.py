"""The decode step's opaque calls as torch custom ops, so that torch.compile traces around them.

Two calls stop a trace: the prepacked oneDNN product (its weight is an mkldnn tensor, which dynamo cannot fake)
and the paged attention (it plans on host arrays and writes the KV pages). Each is registered here with
`torch.library.custom_op` and a fake implementation that only says the output's shape, so dynamo keeps them as
single nodes and inductor fuses the elementwise work between them (services/shard/model/compiled.py).

Neither op takes what differs between layers: the compiled graph is ONE decoder layer, reused by every layer of its
kind, so a product is named by its slot in the running layer's products (`current.products`: q/k/v, o, gate/up,
down) and the attention's layer is `current.layer`. The walk sets both before each layer's call and the step's
PagedBatch around the step (`Current.of`), as vLLM's forward context does; the graph then holds nothing of one
layer and the same model traces the same graph, in this process or the next start, and hits inductor's cache.
"""

from __future__ import annotations

import contextlib

import torch

from services.shard.attention.paged import PagedBatch, attend_layer
from services.shard.model.onednn import linear as onednn_linear

# (packed weight, bias or None, out_features): one product of a layer
Product = tuple[torch.Tensor, torch.Tensor | None, int]


class Current:
    """What the ops read during one compiled call: the step's batch, the running layer and its products."""

    paged: PagedBatch | None = None
    layer: int = -1
    products: list[Product] | None = None

    @contextlib.contextmanager
    def of(self, paged: PagedBatch):
        self.paged = paged
        try:
            yield
        finally:
            self.paged, self.layer, self.products = None, -1, None

    def at(self, layer: int, products: list[Product]) -> None:
        """The layer the next compiled call runs (set by the walk before each layer)."""
        self.layer, self.products = layer, products


current = Current()


@torch.library.custom_op("switchyard::onednn_linear", mutates_args=())
def packed_linear(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    """x [T, in] through the running layer's prepacked product `slot`: [T, out_features]."""
    if current.products is None:
        raise RuntimeError("switchyard::onednn_linear called outside a compiled step (ops.current unset)")
    packed, bias, out = current.products[slot]
    return onednn_linear(x.contiguous(), packed, bias, out)


@packed_linear.register_fake
def _(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("switchyard::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, softcap: float, window: int
) -> torch.Tensor:
    """The running layer's paged attention over the current step (q [T, heads, D], k and v [T, kv_heads, D]): the
    new K/V into the pages (a write the compiled graph never reads: only this op does, layer by layer), [T, heads,
    D] out. `softcap` 0: none."""
    if current.paged is None or current.layer < 0:
        raise RuntimeError("switchyard::paged_attention called outside a compiled step (ops.current unset)")
    out = attend_layer(current.layer, q, k, v, current.paged, scaling, softcap or None, window)
    return out.contiguous()  # the fake's strides: inductor indexes the output as contiguous


@paged_attention.register_fake
def _(q, k, v, scaling, softcap, window):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
