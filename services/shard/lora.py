"""Many LoRA adapters over one base model, mixed in one packed forward.

The registry holds up to `max_loras` adapters, each in a slot. Once per step the runner says which adapter each
row (or packed token) runs with; `group_rows` turns that into, per slot present, the packed token positions of its
rows — a slice when they are contiguous (the common case when rows are ordered by adapter), else an index tensor.
Every targeted linear then computes its base output as before and, for each adapter present, adds
`(x[rows] @ A.T) @ B.T` to those rows only: a shrink to rank r and an expand, two small matmuls per adapter,
with no per-token gather of weights. Base-model rows are never touched.

Small steps (decode, short prefills: at most STACKED_MAX_TOKENS packed tokens) take the stacked form instead:
every adapter of the layer side by side in one [C, in] A and one [C, out] B (C = the sum of their ranks), one
shrink for all tokens, a 0/1 mask that keeps each token's own adapter's columns (base tokens: none), one expand.
Three products per layer whatever the number of adapters present, against four per adapter grouped: in a small
step the products are tiny and their count is the cost (per-call overhead), while the masked-out columns cost
C/in + C/out of the base product's arithmetic. Large steps, where that arithmetic counts, stay grouped.

Hooking: each targeted linear's `forward` is wrapped around whatever forward is installed at that time — torch's,
services/shard/cpu_linear.py's prepacked oneDNN product or its fused q/k/v / gate/up member (which returns this
member's column slice of the fused output: the delta is added in place to those columns only), or transformers'
tensor-parallel forward. So `use_onednn` must run before adapters are loaded (it replaces `forward` itself);
`LoraRegistry.check_hooks` says when something replaced ours afterwards.

Tensor parallel (the wrapper sits outside transformers' TP forward, which does the collectives):
- column-parallel layers (q/k/v/gate/up): x is whole and y is this rank's columns, so the rank holds the rows of B
  for its columns and the full A; no communication.
- row-parallel layers (o/down): x is this rank's slice of the inputs and y is already all-reduced, so the rank
  holds A's columns for its inputs and the full B; the shrink outputs of every adapter present ([rows, r] each,
  small) are summed over the ranks in one all-reduce per layer, then expanded on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.shard.lora_adapter import AdapterError, LoraAdapter, load_adapter

BASE = -1  # the slot of base-model rows
STACKED_MAX_TOKENS = 128  # steps up to this many packed tokens use the stacked products (module docstring)


@dataclass
class RowGroups:
    """One step's rows by adapter slot: (slot, packed token positions) for every slot present, base excluded;
    and each packed token's slot, with the stacked masks built from it (one per column layout and dtype)."""

    num_tokens: int
    groups: list[tuple[int, slice | torch.Tensor]]
    token_slots: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)

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
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot in np.unique(slots).tolist():
        if slot == BASE:
            continue
        idx = np.flatnonzero(per_token == slot)
        if len(idx) == 0:
            continue
        first, last = int(idx[0]), int(idx[-1])
        if last - first + 1 == len(idx):  # contiguous: a view, no gather / scatter
            groups.append((slot, slice(first, last + 1)))
        else:
            groups.append((slot, torch.from_numpy(idx).to(device or "cpu")))
    token_slots = torch.from_numpy(per_token).to(device or "cpu") if len(per_token) <= STACKED_MAX_TOKENS else None
    return RowGroups(int(counts.sum()), groups, token_slots)


def apply_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    groups: RowGroups,
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """y[rows] += (x[rows] @ A.T) @ B.T for each group whose slot has weights (in place where y allows);
    `reduce` (row-parallel layers) sums the shrink outputs over the ranks before the expand."""
    present = [(rows, weights[slot]) for slot, rows in groups.groups if slot in weights]
    if not present:
        return y
    xf = x.reshape(-1, x.shape[-1])
    if xf.shape[0] != groups.num_tokens:
        raise ValueError(f"LoRA: the step's rows cover {groups.num_tokens} tokens, the layer got {xf.shape[0]}")
    try:
        yf = y.view(-1, y.shape[-1])
    except RuntimeError:  # a layout a view cannot flatten: work on a copy
        y = y.contiguous()
        yf = y.view(-1, y.shape[-1])
    shrunk = [(xf[rows] if isinstance(rows, slice) else xf.index_select(0, rows)) @ a.T for rows, (a, _) in present]
    if reduce is not None:
        sizes = [s.numel() for s in shrunk]
        flat = reduce(torch.cat([s.reshape(-1) for s in shrunk]))
        shrunk = [part.view_as(s) for part, s in zip(torch.split(flat, sizes), shrunk)]
    for (rows, (_, b)), s in zip(present, shrunk):
        if isinstance(rows, slice):
            yf[rows].addmm_(s, b.T)
        else:
            yf.index_add_(0, rows, s @ b.T)
    return y


def apply_stacked(
    x: torch.Tensor,
    y: torch.Tensor,
    groups: RowGroups,
    stack: Stack,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """y += ((x @ A_all.T) * mask) @ B_all.T: every adapter of the layer in one shrink and one expand, the mask
    keeping each token's own adapter's columns (`apply_lora`'s result, in three products)."""
    xf = x.reshape(-1, x.shape[-1])
    if xf.shape[0] != groups.num_tokens:
        raise ValueError(f"LoRA: the step's rows cover {groups.num_tokens} tokens, the layer got {xf.shape[0]}")
    try:
        yf = y.view(-1, y.shape[-1])
    except RuntimeError:
        y = y.contiguous()
        yf = y.view(-1, y.shape[-1])
    shrunk = xf @ stack.a.T
    if reduce is not None:  # row-parallel: the partial shrinks of every rank summed
        shrunk = reduce(shrunk)
    shrunk.mul_(groups.mask(stack.layout, stack.column_slots, shrunk.dtype))
    yf.addmm_(shrunk, stack.b_t)
    return y


@dataclass
class Stack:
    """One layer's adapters side by side: A [C, in], B transposed [C, out], and each column's slot."""

    layout: tuple  # ((slot, rank), ...): layers with the same layout share a step's mask
    a: torch.Tensor
    b_t: torch.Tensor
    column_slots: torch.Tensor

    @classmethod
    def of(cls, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Stack | None:
        if not weights:
            return None
        slots = sorted(weights)
        a = torch.cat([weights[s][0] for s in slots])
        b_t = torch.cat([weights[s][1] for s in slots], dim=1).T.contiguous()
        ranks = [weights[s][0].shape[0] for s in slots]
        column_slots = torch.tensor([s for s, r in zip(slots, ranks) for _ in range(r)], device=a.device)
        return cls(tuple(zip(slots, ranks)), a, b_t, column_slots)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t)
    return t


def tp_split(module: torch.nn.Linear) -> tuple[str | None, int, int]:
    """How `module` is sharded over the tensor-parallel group: ("col" | "row" | None, offset, local size) of the
    sharded dimension (outputs for "col", inputs for "row"), read from its local weight's shape."""
    weight = module.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    out_local, in_local = local.shape
    if out_local == module.out_features and in_local == module.in_features:
        return None, 0, 0
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    # DTensor's Shard placement: chunks of ceil(n / world), the last one possibly shorter
    if out_local != module.out_features:
        return "col", rank * -(-module.out_features // world), out_local
    return "row", rank * -(-module.in_features // world), in_local


class LoraLayer:
    """One targeted linear: the installed adapters' (A, B) by slot, and the wrapper around its forward."""

    def __init__(self, module: torch.nn.Linear, registry: LoraRegistry) -> None:
        self.module, self.registry = module, registry
        self.inner = module.forward  # whatever is installed now (torch, oneDNN, fused member, TP)
        self.split, self.offset, self.size = tp_split(module)
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stack: Stack | None = None  # the same weights side by side, for small steps
        module.forward = self.forward

    def install(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.split == "col":
            b = b[self.offset : self.offset + self.size]
        elif self.split == "row":
            a = a[:, self.offset : self.offset + self.size]
        self.weights[slot] = (a.contiguous(), b.contiguous())
        self.stack = Stack.of(self.weights)

    def remove(self, slot: int) -> None:
        if self.weights.pop(slot, None) is not None:
            self.stack = Stack.of(self.weights)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.inner(x, *args, **kwargs)
        groups = self.registry.step_groups
        if groups is None or not self.weights:
            return y
        reduce = _all_reduce if self.split == "row" else None
        if groups.token_slots is not None:
            return apply_stacked(x, y, groups, self.stack, reduce)
        return apply_lora(x, y, groups, self.weights, reduce)


class LoraRegistry:
    """The adapters resident on one model (one shard rank): load / unload by name into `max_loras` slots."""

    def __init__(self, model: torch.nn.Module, *, max_loras: int = 8, max_rank: int = 64) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slots: list[str | None] = [None] * max_loras
        self.adapters: dict[str, LoraAdapter] = {}
        self.layers: dict[str, LoraLayer] = {}
        self.step_groups: RowGroups | None = None
        self.sources: dict[str, tuple[str, int]] = {}  # name → (folder, load generation), for `sync`

    def loaded(self) -> list[str]:
        return [name for name in self.slots if name is not None]

    def slot_of(self, name: str | None) -> int:
        """The slot of a loaded adapter; None or "" is the base model."""
        if not name:
            return BASE
        try:
            return self.slots.index(name)
        except ValueError:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded") from None

    def load(self, name: str, folder) -> LoraAdapter:
        """Read, check and install an adapter; nothing changes if any check fails."""
        if name in self.adapters:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        if None not in self.slots:
            raise AdapterError(
                f"cannot load LoRA adapter {name!r}: {self.max_loras} adapters are loaded (the maximum); unload one"
            )
        adapter = load_adapter(name, folder, self.model, max_rank=self.max_rank)
        slot = self.slots.index(None)
        modules = dict(self.model.named_modules())
        for key, (a, b) in adapter.weights.items():
            layer = self.layers.get(key)
            if layer is None:
                layer = self.layers[key] = LoraLayer(modules[key], self)
            layer.install(slot, a, b)
        self.slots[slot] = name
        self.adapters[name] = adapter
        self.sources[name] = (str(folder), 0)
        return adapter

    def unload(self, name: str) -> None:
        slot = self.slot_of(name)
        for layer in self.layers.values():
            layer.remove(slot)
        self.slots[slot] = None
        del self.adapters[name]
        self.sources.pop(name, None)

    def sync(self, wanted: dict[str, str], generations: dict[str, int] | None = None) -> dict[str, str]:
        """Hold exactly `wanted` (name → folder): drop the others and those whose folder or generation changed
        (a reload under the same name is another adapter), then load what is missing. Returns name → why it
        could not be loaded; the rest holds whatever fails. Idempotent, so a restarted shard gets the same call."""
        generations = generations or {}
        want = {name: (str(folder), generations.get(name, 0)) for name, folder in wanted.items()}
        for name in list(self.adapters):
            if want.get(name) != self.sources.get(name):
                self.unload(name)
        errors = {}
        for name, (folder, gen) in want.items():
            if name in self.adapters:
                continue
            try:
                self.load(name, folder)
            except (AdapterError, OSError, ValueError, RuntimeError) as e:
                errors[name] = str(e)
                continue
            self.sources[name] = (folder, gen)
        return errors

    def check_hooks(self) -> None:
        """Raise if something replaced a wrapped forward after the adapter hooks went on (it would drop them)."""
        for key, layer in self.layers.items():
            if layer.module.forward != layer.forward:
                raise RuntimeError(f"LoRA: the forward of `{key}` was replaced after its adapter hook was installed")

    def set_step(self, adapters: Sequence[str | None], num_tokens: Sequence[int] | np.ndarray | None = None):
        """This step's adapter per row (None / "": base), row i holding num_tokens[i] packed tokens (None: one
        per entry); every targeted linear of the next forward reads the grouping. Returns it."""
        slots = [self.slot_of(a) for a in adapters]
        device = next(self.model.parameters()).device
        self.step_groups = group_rows(slots, num_tokens, device=device) if any(s != BASE for s in slots) else None
        return self.step_groups

    def clear_step(self) -> None:
        self.step_groups = None
