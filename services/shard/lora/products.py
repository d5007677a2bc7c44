"""One step's LoRA products, the functions services/shard/lora/registry.py's layers call: the step's rows grouped by
adapter slot (`group_rows`, once per step), and the two forms of the adapters' products (registry.py's docstring
says which runs when):
- grouped: `shrink` gathers the adapter tokens once and multiplies each slot's run of them by that slot's A;
  `expand` writes every slot's delta into one buffer and adds it back in one scatter (a slice when the adapter
  tokens are one run);
- stacked: `Stack.shrink`, every adapter's A side by side in one product and a 0/1 mask keeping each token's own
  adapter's columns; `expand_stacked`, one product adding this layer's columns to every token (base tokens get
  exact zeros).
Row-parallel layers pass `reduce` (the all-reduce over the tensor-parallel ranks) to the shrinks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

BASE = -1  # the slot of base-model rows
STACKED_MAX_TOKENS = 1024  # above this the per-token slots (and masks) are not even built


@dataclass
class RowGroups:
    """One step's adapter tokens: their packed positions ordered by slot (`order`: a slice when they are one
    contiguous run in that order, else an index tensor), each slot's run of them (slot, start, end); and, in
    small steps, each packed token's slot, with the stacked masks built from it (one per column layout)."""

    num_tokens: int
    order: slice | torch.Tensor
    segments: list[tuple[int, int, int]]
    count: int
    token_slots: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)

    @property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, packed positions) per slot present (for tests and tools)."""
        if isinstance(self.order, slice):
            return [(s, slice(self.order.start + a, self.order.start + b)) for s, a, b in self.segments]
        return [(s, self.order[a:b]) for s, a, b in self.segments]

    def check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"LoRA: the step's rows cover {self.num_tokens} tokens, the layer got {x.shape[0]}")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter tokens' rows of x [num_tokens, in], in `order`."""
        self.check(x)
        return x[self.order] if isinstance(self.order, slice) else x.index_select(0, self.order)

    def add_to(self, y: torch.Tensor, delta: torch.Tensor) -> None:
        """y[order] += delta ([count, out], in `order`), in place."""
        if isinstance(self.order, slice):
            y[self.order].add_(delta)
        else:  # index_add_ into a fused product's column slice (strided rows) runs far slower than these three
            rows = y.index_select(0, self.order)
            rows.add_(delta)
            y.index_put_((self.order,), rows)

    def mask(self, layout: tuple, column_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, C]: 1 where the column belongs to the token's adapter (layers of one layout share it)."""
        key = (layout, dtype)
        m = self.masks.get(key)
        if m is None:
            m = self.masks[key] = (self.token_slots[:, None] == column_slots[None, :]).to(dtype)
        return m


def group_rows(slots: Sequence[int] | np.ndarray, num_tokens: Sequence[int] | np.ndarray | None = None, device=None):
    """Group packed rows by slot; row i holds `num_tokens[i]` consecutive tokens (None: one token per entry)."""
    slots = np.asarray(slots, dtype=np.int64)
    counts = np.ones(len(slots), dtype=np.int64) if num_tokens is None else np.asarray(num_tokens, dtype=np.int64)
    per_token = np.repeat(slots, counts)
    positions = np.flatnonzero(per_token != BASE)
    order = positions[np.argsort(per_token[positions], kind="stable")]
    by_slot = per_token[order]
    starts = np.flatnonzero(np.diff(by_slot, prepend=BASE - 1))
    ends = np.append(starts[1:], len(order))
    segments = [(int(by_slot[s]), int(s), int(e)) for s, e in zip(starts, ends)]
    if len(order) and int(order[-1]) - int(order[0]) + 1 == len(order) and bool(np.all(np.diff(order) == 1)):
        rows: slice | torch.Tensor = slice(int(order[0]), int(order[-1]) + 1)  # a view: no gather, no scatter
    else:
        rows = torch.from_numpy(order).to(device or "cpu")
    small = len(per_token) <= STACKED_MAX_TOKENS
    token_slots = torch.from_numpy(per_token).to(device or "cpu") if small else None
    return RowGroups(int(counts.sum()), rows, segments, len(order), token_slots)


def shrink(
    x: torch.Tensor,
    groups: RowGroups,
    a_by_slot: dict[int, torch.Tensor],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """slot → x[its rows] @ A.T ([rows, r]) for every slot of the step with an A here; `reduce` (row-parallel
    layers) sums them over the ranks, all in one call."""
    present = [(slot, start, end) for slot, start, end in groups.segments if slot in a_by_slot]
    if not present:
        return {}
    xg = groups.gather(x.reshape(-1, x.shape[-1])).to(next(iter(a_by_slot.values())).dtype)
    out = {slot: xg[start:end] @ a_by_slot[slot].T for slot, start, end in present}
    if reduce is not None:
        parts = list(out.values())
        flat = reduce(torch.cat([p.reshape(-1) for p in parts]))
        out = {slot: t.view_as(p) for slot, t, p in zip(out, torch.split(flat, [p.numel() for p in parts]), parts)}
    return out


def _flat(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, y as [tokens, out]) sharing memory; a layout a view cannot flatten is copied first."""
    try:
        return y, y.view(-1, y.shape[-1])
    except RuntimeError:
        y = y.contiguous()
        return y, y.view(-1, y.shape[-1])


def expand(
    y: torch.Tensor,
    groups: RowGroups,
    shrunk: dict[int, torch.Tensor],
    b_by_slot: dict[int, tuple[int, int, torch.Tensor]],
) -> torch.Tensor:
    """y[rows of slot] += shrunk[slot][:, c0:c1] @ B.T for each slot with (c0, c1, B.T) here: every delta into one
    buffer (a slot without a B here leaves its rows zero), added to y in one go (in place where y allows)."""
    present = [(slot, start, end) for slot, start, end in groups.segments if slot in b_by_slot and slot in shrunk]
    if not present:
        return y
    y, yf = _flat(y)
    make = torch.empty if len(present) == len(groups.segments) else torch.zeros
    dtype = b_by_slot[present[0][0]][2].dtype  # the adapters' (the model's unless the registry says otherwise)
    delta = make(groups.count, yf.shape[1], dtype=dtype, device=y.device)
    for slot, start, end in present:
        c0, c1, b_t = b_by_slot[slot]
        torch.mm(shrunk[slot][:, c0:c1], b_t, out=delta[start:end])
    groups.add_to(yf, delta)
    return y


@dataclass
class Stack:
    """Adapters side by side for the stacked form: A [C, in] (a family's members one after the other, each with
    every slot's rows), each column's slot, and the layout (which layers' masks are the same)."""

    layout: tuple
    a: torch.Tensor
    column_slots: torch.Tensor

    def shrink(self, x: torch.Tensor, groups: RowGroups, reduce=None) -> torch.Tensor:
        """((x @ A.T) summed over the ranks by `reduce`) * mask: [tokens, C], each token's own adapter's columns."""
        xf = x.reshape(-1, x.shape[-1])
        groups.check(xf)
        shrunk = xf.to(self.a.dtype) @ self.a.T
        if reduce is not None:  # row-parallel: the partial shrinks of every rank summed
            shrunk = reduce(shrunk)
        return shrunk.mul_(groups.mask(self.layout, self.column_slots, shrunk.dtype))


def expand_stacked(y: torch.Tensor, shrunk: torch.Tensor, columns: tuple[int, int, torch.Tensor]) -> torch.Tensor:
    """y += shrunk[:, c0:c1] @ B.T: this layer's columns of the masked shrink (base tokens add exact zeros)."""
    c0, c1, b_t = columns
    y, yf = _flat(y)
    if yf.dtype == b_t.dtype:
        yf.addmm_(shrunk[:, c0:c1], b_t)
    else:  # adapters in another dtype than the model's: the delta rounded once into y
        yf.add_(shrunk[:, c0:c1] @ b_t)
    return y
