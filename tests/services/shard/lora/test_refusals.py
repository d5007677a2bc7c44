"""LoRA adapters refused with a clear message (config, files, shapes, the registry's limits), and the registry's
run-time set (hooks, sync). The adapters are test_lora.py's, built once per session (conftest.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.shard.lora.adapter import AdapterError, load_adapter
from services.shard.lora.registry import LoraRegistry
from services.shard.model.onednn import use_onednn
from tests.lora_adapters import ATOL, base_model, peft_logits


def _copy(adapters, tmp_path, name="all", arch="llama"):
    folder = tmp_path / name
    shutil.copytree(adapters[arch, name], folder)
    return folder


def _edit(folder, **changes):
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(use_dora=True), "'x': uses DoRA"),
        (dict(modules_to_save=["lm_head"]), r"'x': trains whole modules \(modules_to_save"),
        (dict(target_modules=["embed_tokens"]), "'x' targets the embedding `model.embed_tokens`"),
        (dict(target_modules=["lm_head"]), "'x' targets the LM head `lm_head`"),
        (dict(target_modules=["mlp"]), "'x' targets `model.layers.0.mlp`, a LlamaMLP: only linear layers"),
        (dict(target_modules=["nothing"]), r"'x': target_modules \['nothing'\] match no linear layer"),
        (dict(r=0), "malformed adapter_config.json: `r` must be a positive integer, got 0"),
        (dict(target_modules=7), "malformed adapter_config.json: `target_modules` must be"),
        (dict(peft_type="IA3"), "'x': is a IA3 adapter"),
        (dict(bias="all"), "trains biases"),
        (dict(rank_pattern={"q_proj": 3}), r"does not fit the base model: `model.layers.0.self_attn.q_proj` takes"),
        (
            dict(target_modules=["q_proj"]),
            r"holds weights for `model\.layers\.\d\.(self_attn\.[kvo]|mlp\.\w+)_proj`, which is not a module its",
        ),
        (
            dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_"]),
            None,
        ),  # an extra name that matches nothing changes nothing
    ],
)
def test_config_refusals(tiny_dirs, adapters, tmp_path, changes, message):
    folder = _copy(adapters, tmp_path)
    _edit(folder, **changes)
    model = base_model(tiny_dirs["llama"])
    if message is None:
        load_adapter("x", folder, model)
        return
    with pytest.raises(AdapterError, match=message):
        load_adapter("x", folder, model)


def test_file_refusals(tiny_dirs, adapters, tmp_path):
    model = base_model(tiny_dirs["llama"])
    with pytest.raises(AdapterError, match="'x': folder .* does not exist"):
        load_adapter("x", tmp_path / "nope", model)
    folder = _copy(adapters, tmp_path)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="'x': malformed adapter_config.json: Expecting"):
        load_adapter("x", folder, model)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        load_adapter("x", folder, model)
    folder = _copy(adapters, tmp_path, "mlp")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors .adapter_model.bin is pickle"):
        load_adapter("x", folder, model)
    (folder / "adapter_model.bin").write_bytes(b"\x00" * 10)
    (folder / "adapter_model.bin").rename(folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="'x': cannot read adapter_model.safetensors"):
        load_adapter("x", folder, model)
    folder = _copy(adapters, tmp_path, "qv_rs")
    _edit(folder, target_modules=["q_proj", "v_proj", "o_proj"])
    with pytest.raises(AdapterError, match="lacks lora_A/lora_B of `model.layers.0.self_attn.o_proj`"):
        load_adapter("x", folder, model)


def test_adapter_of_another_model_does_not_fit(tiny_dirs, adapters):
    # llama's k_proj is 64 → 64 (MHA), qwen2's 64 → 32 (GQA): same names, other shapes
    with pytest.raises(AdapterError, match=r"`model.layers.0.self_attn.k_proj` takes 64 inputs to 32 outputs"):
        load_adapter("x", adapters["llama", "all"], base_model(tiny_dirs["qwen2"]))


def test_registry_limits(tiny_dirs, adapters):
    registry = LoraRegistry(base_model(tiny_dirs["llama"]), max_loras=2, max_rank=8)
    with pytest.raises(AdapterError, match=r"'mlp': rank 16 of `model.layers.0.mlp.gate_proj` is above the maximum"):
        registry.load("mlp", adapters["llama", "mlp"])
    assert registry.loaded() == [] and registry.layers == {}  # nothing half-installed
    registry.load("a", adapters["llama", "all"])
    with pytest.raises(AdapterError, match="'a' is already loaded"):
        registry.load("a", adapters["llama", "qv_rs"])
    registry.load("b", adapters["llama", "qv_rs"])
    with pytest.raises(AdapterError, match="cannot load LoRA adapter 'c': 2 adapters are loaded"):
        registry.load("c", adapters["llama", "regex"])


def test_replacing_a_hooked_forward_is_caught(tiny_dirs, adapters):
    model = base_model(tiny_dirs["llama"])
    registry = LoraRegistry(model)
    registry.load("a", adapters["llama", "all"])
    use_onednn(model)  # the wrong order: it replaces the forwards our hooks wrapped
    with pytest.raises(RuntimeError, match="was replaced after its adapter hook"):
        registry.check_hooks()


def test_sync_holds_exactly_the_wanted_set(tiny_dirs, adapters, reference, tmp_path):
    """The shard's side of hot load/unload: the scheduler's whole run-time set, applied as a diff (idempotent, so a
    restarted shard gets the same call); a refused adapter leaves the others loaded; a new generation reloads."""
    registry = LoraRegistry(base_model(tiny_dirs["llama"]), max_loras=3, max_rank=16)
    folders = {name: str(adapters["llama", name]) for name in ("all", "mlp")}
    assert registry.sync(folders) == {} and registry.loaded() == ["all", "mlp"]
    first = registry.adapters["all"]
    assert registry.sync(folders) == {} and registry.adapters["all"] is first  # nothing reloaded
    broken = _copy(adapters, tmp_path)
    (broken / "adapter_model.safetensors").unlink()
    errors = registry.sync({**folders, "bad": str(broken)})
    assert list(errors) == ["bad"] and "adapter_model.safetensors" in errors["bad"]
    assert registry.loaded() == ["all", "mlp"]
    # "all" unloaded; "mlp" reloaded under its name from other weights (a new generation); "qv" added
    errors = registry.sync({"mlp": str(adapters["llama", "qv_rs"]), "qv": str(adapters["llama", "qv_rs"])}, {"mlp": 1})
    assert errors == {} and sorted(registry.loaded()) == ["mlp", "qv"] and "all" not in registry.adapters
    input_ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(2))
    registry.set_step(["mlp", "qv"], [10, 10])
    with torch.no_grad():
        ours = registry.model(input_ids=input_ids).logits
    registry.clear_step()
    torch.testing.assert_close(ours, peft_logits(reference["llama"], "qv_rs", input_ids), atol=ATOL, rtol=0)
    assert registry.sync({}) == {} and registry.loaded() == []
