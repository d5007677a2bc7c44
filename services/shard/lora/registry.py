"""Many LoRA adapters over one base model, mixed in one packed forward (docs/lora.md tells the design and why).

The registry holds up to `max_loras` adapters in slots; `set_step` says which adapter each row runs with, and every
targeted linear adds `(x[rows] @ A.T) @ B.T` per adapter present to its rows only: base rows stay the base product
bit for bit. Siblings that read one input (q/k/v, gate/up) share the shrink (`SharedShrink`). Small steps take the
stacked form (every adapter's A side by side, a 0/1 mask, one expand; folded into the base product by fold.py where
it applies), large ones group rows by adapter (products.py); the choice is per layer family (STACKED_MAX_WORK). Each
targeted linear's `forward` wraps whatever is installed then (torch's, oneDNN's packed or fused member, a quantized
layer's, transformers' tensor-parallel one), so `use_onednn` must run before adapters load; `check_hooks` says when
something replaced a wrapper. Under tensor parallelism a rank holds B's rows of its output columns, or A's columns
of its inputs (row-parallel layers, whose shrinks are all-reduced once per layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.shard.lora.adapter import AdapterError, LoraAdapter, load_adapter
from services.shard.lora.fold import FoldedProduct, group_of
from services.shard.lora.products import (
    BASE,
    RowGroups,
    Stack,
    expand,
    expand_stacked,
    group_rows,
    shrink,
)
from services.shard.model.onednn import FUSED_GROUPS
from services.shard.tensor_parallel import tp_split

# The stacked form (module docstring) runs while tokens x a layer's stacked columns stay within STACKED_MAX_WORK
# (about 1k tokens with 4 adapters of r 16); past it the masked-out columns' arithmetic counts and rows are grouped.
STACKED_MAX_WORK = 1024 * 64


class SharedShrink:
    """The shrink of projections that read the same input (q/k/v, gate/up of one module; any other layer alone):
    their A side by side, one product for all of them — per adapter present in large steps (`a`: slot → the
    members' A of that slot), one for every adapter in small ones (`stack`). Computed at the first member's call
    for an input and handed to the others while they are called with that same tensor in that step (as
    onednn.py's fused product); a member called again, or with another input, computes it anew."""

    def __init__(self, members: list[LoraLayer], fold: bool = True) -> None:
        self.members = members
        self.reduce = _all_reduce if members[0].split == "row" else None
        self.a: dict[int, torch.Tensor] = {}
        for slot in sorted(set().union(*(m.weights for m in members))):
            parts, col = [], 0
            for m in members:
                if slot in m.weights:
                    a, b = m.weights[slot]
                    m.expand_weights[slot] = (col, col + a.shape[0], b.T.contiguous())
                    parts.append(a)
                    col += a.shape[0]
            self.a[slot] = torch.cat(parts) if len(parts) > 1 else parts[0]
        parts, column_slots, col = [], [], 0
        for m in members:
            slots = sorted(m.weights)
            a = torch.cat([m.weights[s][0] for s in slots])
            b_t = torch.cat([m.weights[s][1] for s in slots], dim=1).T.contiguous()
            m.stacked_columns = (col, col + a.shape[0], b_t)
            parts.append(a)
            column_slots += [s for s in slots for _ in range(m.weights[s][0].shape[0])]
            col += a.shape[0]
        device = parts[0].device
        self.stack = Stack(tuple(column_slots), torch.cat(parts), torch.tensor(column_slots, device=device))
        self.width = -(-col // len(members))  # stacked columns per member: what the masked products cost
        self.folded: FoldedProduct | None = None  # the stack folded into the base product (fold.py)
        modules = group_of(members, self.stack.a.dtype) if fold else None
        if modules is not None:
            columns = {id(m.module): m.stacked_columns for m in members}
            registry = members[0].registry
            self.folded = FoldedProduct(modules, self.stack, columns, lambda: registry.step_groups)
        self._key: tuple | None = None  # (input, step grouping) the held shrink was computed for
        self._shrunk = None
        self._unserved: set[int] = set()

    def stacked(self, groups: RowGroups) -> bool:
        """Whether this step takes the stacked form in this family (small steps; module docstring)."""
        return groups.token_slots is not None and groups.num_tokens * self.width <= STACKED_MAX_WORK

    def shrunk_for(self, member: int, x: torch.Tensor, groups: RowGroups):
        """The family's shrink of x: a masked [tokens, C] tensor in small steps, else slot → [rows, r]."""
        key = self._key
        if key is None or key[0] is not x or key[1] is not groups or member not in self._unserved:
            if self.stacked(groups):
                shrunk = self.stack.shrink(x, groups, self.reduce)
            else:
                shrunk = shrink(x, groups, self.a, self.reduce)
            self._key, self._shrunk = (x, groups), shrunk
            self._unserved = set(range(len(self.members)))
        shrunk = self._shrunk
        self._unserved.discard(member)
        if not self._unserved:  # every member has it: let the activations go
            self._key, self._shrunk = None, None
        return shrunk


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t)
    return t


class LoraLayer:
    """One targeted linear: the installed adapters' (A, B) by slot (this rank's part), the shrink it shares with
    its siblings, and the wrapper around its forward."""

    def __init__(self, module: torch.nn.Linear, registry: LoraRegistry) -> None:
        self.module, self.registry = module, registry
        self.inner = module.forward  # whatever is installed now (torch, oneDNN, fused member, quantized, TP)
        self.split, self.offset, self.size = tp_split(module)
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.expand_weights: dict[int, tuple[int, int, torch.Tensor]] = {}  # slot → its shrink columns, B.T
        self.stacked_columns: tuple[int, int, torch.Tensor] | None = None  # its columns of the stack, B.T
        self.shared: SharedShrink | None = None
        self.member = 0  # this layer's index in `shared`
        module.forward = self.forward

    def install(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.split == "col":
            b = b[self.offset : self.offset + self.size]
        elif self.split == "row":
            a = a[:, self.offset : self.offset + self.size]
        self.weights[slot] = (a.contiguous(), b.contiguous())

    def remove(self, slot: int) -> None:
        self.weights.pop(slot, None)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        groups, shared = self.registry.step_groups, self.shared
        if groups is not None and shared is not None and shared.folded is not None and shared.stacked(groups):
            # base product, shrink and expand in one
            return shared.folded.columns_for(shared.folded.member[id(self.module)], x)
        y = self.inner(x, *args, **kwargs)
        if groups is None or shared is None:
            return y
        shrunk = shared.shrunk_for(self.member, x, groups)
        if isinstance(shrunk, torch.Tensor):  # the stacked form
            return expand_stacked(y, shrunk, self.stacked_columns)
        return expand(y, groups, shrunk, self.expand_weights)


def _siblings_key(key: str, layer: LoraLayer) -> tuple:
    """Layers with the same key share their shrink: q/k/v (gate/up) of one module, split alike (row-parallel
    siblings would need the same input slice); any other layer is alone."""
    parent, _, name = key.rpartition(".")
    family = next((names for names in FUSED_GROUPS if name in names), None)
    if family is None:
        return (key,)
    return (parent, family, layer.split, layer.offset if layer.split == "row" else 0, layer.module.in_features)


class LoraRegistry:
    """The adapters resident on one model (one shard rank): load / unload by name into `max_loras` slots."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_loras: int = 8,
        max_rank: int = 64,
        dtype: torch.dtype | None = None,
        fold: bool = True,
    ) -> None:
        self.model = model
        self.fold = fold  # small steps' shrink folded into the base product where it applies (fold.py)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype = dtype  # the adapters' weights and products (None: the model's; docs/lora.md tells when not)
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
        adapter = load_adapter(name, folder, self.model, max_rank=self.max_rank, dtype=self.dtype)
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
        self._share()
        return adapter

    def unload(self, name: str) -> None:
        slot = self.slot_of(name)
        for layer in self.layers.values():
            layer.remove(slot)
        self.slots[slot] = None
        del self.adapters[name]
        self.sources.pop(name, None)
        self._share()

    def _share(self) -> None:
        """Regroup the layers that hold weights by the shrink they share (after every load and unload)."""
        families: dict[tuple, list[LoraLayer]] = {}
        for key, layer in self.layers.items():
            layer.shared, layer.expand_weights, layer.stacked_columns = None, {}, None
            if layer.weights:
                families.setdefault(_siblings_key(key, layer), []).append(layer)
        for members in families.values():
            shared = SharedShrink(members, self.fold)
            for i, layer in enumerate(members):
                layer.shared, layer.member = shared, i

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
