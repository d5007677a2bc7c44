"""Quantizing at load keeps no float copy: each float linear is gone as soon as its quantized layer replaces it, and
what stays dense leaves the checkpoint's memory map, so the map (and the replaced weights' pages in it) goes."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.shard.quant import layers as quant_layers
from services.shard.quant import loader as ql


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process that map `path` (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5].strip()) == path:
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


@pytest.mark.parametrize("method", ["eetq", "bitsandbytes-nf4"])
def test_each_float_linear_is_freed_when_its_layer_is_quantized(tiny_dirs, method, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16)
    linears = [m for n, m in model.named_modules() if type(m) is torch.nn.Linear and not n.endswith("lm_head")]
    alive = [weakref.ref(m) for m in linears]
    del linears
    seen_alive = []
    real_replace = ql._replace

    def counting_replace(model, name, qw, **kw):  # how many float linears are still alive at each swap
        # no gc.collect() here: a swapped linear goes by reference count, at once (a full collection per swap, in a
        # long test session's heap, cost seconds)
        seen_alive.append(sum(r() is not None for r in alive))
        real_replace(model, name, qw, **kw)

    monkeypatch.setattr(ql, "_replace", counting_replace)  # the real swap, counted
    replaced = ql.quantize_model(model, method)
    gc.collect()
    assert replaced == len(alive) == 7 * model.config.num_hidden_layers
    # layer i is swapped while len − i float linears live: the earlier ones were freed, none is held for later
    assert seen_alive == [len(alive) - i for i in range(len(alive))]
    assert all(r() is None for r in alive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_of_the_model_stays_in_the_checkpoint_map(tiny_dirs, dtype):
    weights = (tiny_dirs["llama"] / "model.safetensors").resolve()
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=dtype)
    ranges = _mapped_ranges(weights)
    on_map = [n for n, p in dense.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]
    if dtype == torch.float32:  # the premise: transformers serves a float32 load straight from the file's map
        assert on_map, "the float32 load did not map the checkpoint: this test no longer checks anything"
    del dense, on_map
    gc.collect()

    quant = ql.from_pretrained(str(tiny_dirs["llama"]), "eetq", dtype=dtype)
    gc.collect()
    assert sum(isinstance(m, quant_layers.W8A8Linear) for m in quant.modules()) == 7 * quant.config.num_hidden_layers
    # other tests' models in this process may still map the same file: check what this model holds
    ranges = _mapped_ranges(weights)
    assert [n for n, t in _tensors(quant) if any(lo <= t.data_ptr() < hi for lo, hi in ranges)] == []


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the model holds: parameters, buffers and plain tensor attributes (the quantized layers')."""
    out = [*model.named_parameters(), *model.named_buffers()]
    for name, module in model.named_modules():
        out += [(f"{name}.{k}", v) for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
    return out
