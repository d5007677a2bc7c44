"""LoRA adapters: our grouped apply against peft's PeftModel (the reference), and every refusal's message.

The adapters are built here with peft on the tiny models, with A and B drawn at random (peft starts B at zero,
which would hide any mistake in the B side and in the scaling), and saved as peft saves them.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.shard import lora, lora_fused, lora_products
from services.shard.cpu_linear import use_onednn
from services.shard.lora import STACKED_MAX_TOKENS, LoraRegistry
from services.shard.lora_adapter import AdapterError, load_adapter
from tests.shard.test_lora_products import reference_delta

peft = pytest.importorskip("peft")

# Ours and peft's differ only in summation order (B folded with its scale, oneDNN / fused q/k/v products):
# measured max |diff| 4.9e-6 (llama) and 3.9e-6 (qwen2) on logits of magnitude ~10, so 5e-5 is a 10x margin,
# while a wrong scale, slot or row moves the logits by more than 1e-1 (asserted below).
ATOL = 5e-5

ADAPTERS = {
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "qv_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(
        r=8,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
        exclude_modules=["k_proj"],
        layers_to_transform=[1],
        rank_pattern={"o_proj": 4},
        alpha_pattern={"down_proj": 3},
    ),
    "regex": dict(r=2, lora_alpha=5, target_modules=r".*\.0\.(self_attn\.v_proj|mlp\.up_proj)"),
}


def _base(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _build_adapter(model_dir, out, seed: int, **kwargs):
    model = peft.get_peft_model(_base(model_dir), peft.LoraConfig(lora_dropout=0.0, **kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(out)
    return out


def build_adapters(tiny_dirs, root) -> dict:
    """(arch, name) → folder of every ADAPTERS entry on the tiny llama and qwen2."""
    return {
        (arch, name): _build_adapter(tiny_dirs[arch], root / arch / name, seed=i, **cfg)
        for arch in ("llama", "qwen2")
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


def build_reference(tiny_dirs, adapters) -> dict:
    """arch → PeftModel holding every adapter of that arch."""
    refs = {}
    for arch in ("llama", "qwen2"):
        names = list(ADAPTERS)
        ref = peft.PeftModel.from_pretrained(_base(tiny_dirs[arch]), adapters[arch, names[0]], adapter_name=names[0])
        for name in names[1:]:
            ref.load_adapter(adapters[arch, name], adapter_name=name)
        refs[arch] = ref.eval()
    return refs


@pytest.fixture(scope="module")
def adapters(tiny_dirs, tmp_path_factory):
    return build_adapters(tiny_dirs, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def reference(tiny_dirs, adapters):
    return build_reference(tiny_dirs, adapters)


def _peft_logits(ref, name: str | None, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if name is None:
            with ref.disable_adapter():
                return ref(input_ids=input_ids).logits
        ref.set_adapter(name)
        return ref(input_ids=input_ids).logits


def _registry(model_dir, adapters, arch, onednn: bool, **kwargs) -> LoraRegistry:
    model = _base(model_dir)
    if onednn:
        assert use_onednn(model) > 0  # before the hooks: they wrap the fused products
        assert hasattr(model.model.layers[0].self_attn.q_proj, "fused_product")
    registry = LoraRegistry(model, **kwargs)
    for name in ADAPTERS:
        registry.load(name, adapters[arch, name])
    registry.check_hooks()
    return registry


# base rows and four adapters, the same adapter on rows apart (gathered) and side by side (a slice)
ROWS = [None, "all", "qv_rs", "all", "mlp", None, "patterns", "patterns", "regex"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("form", ["stacked", "grouped", "grouped by work"])
def test_mixed_batch_equals_peft(tiny_dirs, adapters, reference, arch, onednn, form, monkeypatch):
    registry = _registry(tiny_dirs[arch], adapters, arch, onednn)
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, 500, (len(ROWS), 12), generator=gen)
    if form == "grouped":  # these 108 tokens would be a small step: make every step large
        monkeypatch.setattr(lora_products, "STACKED_MAX_TOKENS", 0)
    if form == "grouped by work":  # per-token slots built, but every layer's masked products judged too large
        monkeypatch.setattr(lora, "STACKED_MAX_WORK", 12)
    calls = {"stacked": 0, "grouped": 0, "folded": 0}  # which form each layer ran
    for fn, key in ((lora.expand_stacked, "stacked"), (lora.expand, "grouped")):
        monkeypatch.setattr(
            lora, fn.__name__, lambda *a, fn=fn, key=key: calls.__setitem__(key, calls[key] + 1) or fn(*a)
        )
    product = lora_fused.FoldedProduct.product
    monkeypatch.setattr(
        lora_fused.FoldedProduct, "product", lambda *a: calls.__setitem__("folded", calls["folded"] + 1) or product(*a)
    )
    groups = registry.set_step(ROWS, [12] * len(ROWS))
    assert (groups.token_slots is not None) == (form != "grouped")
    with torch.no_grad():
        ours = registry.model(input_ids=input_ids).logits
    # small steps: the stacked form, folded into the base product where that is oneDNN's (every projection here)
    ran = (calls["stacked"] > 0, calls["folded"] > 0, calls["grouped"] > 0)
    assert ran == ((not onednn, onednn, False) if form == "stacked" else (False, False, True)), calls
    worst = 0.0
    for name in set(ROWS):
        rows = [i for i, r in enumerate(ROWS) if r == name]
        want = _peft_logits(reference[arch], name, input_ids[rows])
        torch.testing.assert_close(ours[rows], want, atol=ATOL, rtol=0)
        worst = max(worst, (ours[rows] - want).abs().max().item())
        if name is not None:  # the adapter really changes the output (so the comparison can fail)
            assert (want - _peft_logits(reference[arch], None, input_ids[rows])).abs().max() > 1e-1
    print(f"{arch} onednn={onednn} {form}: max |ours - peft| = {worst:.2e}")


def test_unload_frees_the_slot_and_leaves_the_others(tiny_dirs, adapters, reference):
    registry = _registry(tiny_dirs["llama"], adapters, "llama", onednn=True, max_loras=len(ADAPTERS))
    input_ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(1))
    registry.unload("qv_rs")
    with pytest.raises(AdapterError, match="'qv_rs' is not loaded"):
        registry.set_step(["qv_rs", None], [10, 10])
    registry.set_step(["all", "mlp"], [10, 10])
    with torch.no_grad():
        ours = registry.model(input_ids=input_ids).logits
    torch.testing.assert_close(ours[:1], _peft_logits(reference["llama"], "all", input_ids[:1]), atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[1:], _peft_logits(reference["llama"], "mlp", input_ids[1:]), atol=ATOL, rtol=0)
    registry.load("again", adapters["llama", "qv_rs"])  # into the freed slot
    assert registry.slot_of("again") == 1 and registry.loaded()[1] == "again"
    registry.set_step(["again", None], [10, 10])
    with torch.no_grad():
        ours = registry.model(input_ids=input_ids).logits
    torch.testing.assert_close(ours[:1], _peft_logits(reference["llama"], "qv_rs", input_ids[:1]), atol=ATOL, rtol=0)
    registry.clear_step()
    with torch.no_grad():
        base = registry.model(input_ids=input_ids).logits
    torch.testing.assert_close(base, _peft_logits(reference["llama"], None, input_ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tokens", [1, STACKED_MAX_TOKENS // 2])  # a small step (stacked), a large one (grouped)
@pytest.mark.parametrize("adapter_dtype", [None, torch.float64])  # the model's, or another (a mixed-dtype delta)
def test_siblings_share_one_shrink(tiny_dirs, adapters, tokens, adapter_dtype):
    """q/k/v (gate/up) of a layer read the same input: one shrink serves all of them (counted) and gives what each
    layer alone gives; a sibling called with another tensor computes its own."""
    registry = _registry(tiny_dirs["llama"], adapters, "llama", onednn=True, dtype=adapter_dtype)
    assert registry.layers["model.layers.0.mlp.up_proj"].weights[0][0].dtype == (adapter_dtype or torch.float32)
    attn = registry.model.model.layers[0].self_attn
    q, k, v = (registry.layers[f"model.layers.0.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj"))
    assert q.shared is k.shared is v.shared and q.shared is not registry.layers["model.layers.0.mlp.up_proj"].shared
    # "all" targets q, k and v (rank 8 each): its A in the shared shrink holds the three side by side
    assert q.shared.a[registry.slot_of("all")].shape[0] == 24
    rows = ["all", None, "qv_rs", "all"]
    registry.set_step(rows, [tokens] * len(rows))
    assert (registry.step_groups.token_slots is not None) == (tokens * len(rows) <= STACKED_MAX_TOKENS)
    calls = []
    q.shared.reduce = lambda t: calls.append(t.shape) or t  # counts each shrink computed (a no-op sum)
    folded = q.shared.folded  # small steps in the model's dtype: the shrink is folded into the base product
    assert (folded is not None) == (adapter_dtype is None)

    def shrinks() -> int:
        return len(calls) + (folded.calls if folded is not None and registry.step_groups.token_slots is not None else 0)

    x = torch.randn(tokens * len(rows), attn.q_proj.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        together = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        assert shrinks() == 1
        alone = [attn.q_proj(x.clone()), attn.k_proj(x.clone()), attn.v_proj(x.clone())]
        assert shrinks() == 4
        base = [layer.inner(x) for layer in (q, k, v)]
    registry.clear_step()
    slots = np.repeat([registry.slot_of(r) for r in rows], tokens).tolist()
    for got, got_alone, layer, b in zip(together, alone, (q, k, v), base):
        torch.testing.assert_close(got, got_alone, atol=0, rtol=0)
        torch.testing.assert_close(got, b + reference_delta(x, slots, layer.weights), atol=1e-5, rtol=1e-5)


def test_folded_only_where_the_family_is_a_whole_packed_product(tiny_dirs, adapters, reference):
    """With q/v adapted but not k, the q/k/v family keeps its own shrink (k's fused columns would be computed
    again); the MLP's gate/up (and down alone) fold. Base rows of a folded step are the base model's bit for bit,
    adapter rows peft's."""
    model = _base(tiny_dirs["llama"])
    use_onednn(model)
    registry = LoraRegistry(model)
    registry.load("qv_rs", adapters["llama", "qv_rs"])
    registry.load("mlp", adapters["llama", "mlp"])
    layer = "model.layers.0"
    assert registry.layers[f"{layer}.self_attn.q_proj"].shared.folded is None
    up, down = registry.layers[f"{layer}.mlp.up_proj"].shared, registry.layers[f"{layer}.mlp.down_proj"].shared
    assert up.folded is not None and down.folded is not None and up is not down
    input_ids = torch.randint(3, 500, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = model(input_ids=input_ids).logits
        registry.set_step([None, "mlp", "qv_rs"], [10, 10, 10])
        ours = model(input_ids=input_ids).logits
    registry.clear_step()
    assert up.folded.calls > 0 and down.folded.calls > 0
    assert torch.equal(ours[0], base[0])
    unfolded = LoraRegistry(model, fold=False)  # --disable-lora-fold: nothing folds, the same outputs
    registry.unload("qv_rs")
    registry.unload("mlp")
    unfolded.load("mlp", adapters["llama", "mlp"])
    assert all(layer.shared.folded is None for layer in unfolded.layers.values())
    with torch.no_grad():
        unfolded.set_step([None, "mlp", "mlp"], [10, 10, 10])
        torch.testing.assert_close(model(input_ids=input_ids).logits[:2], ours[:2], atol=1e-5, rtol=0)
    for i, name in ((1, "mlp"), (2, "qv_rs")):
        torch.testing.assert_close(
            ours[i : i + 1], _peft_logits(reference["llama"], name, input_ids[i : i + 1]), atol=ATOL, rtol=0
        )


def test_the_two_expand_forms_give_the_same_logits(tiny_dirs, adapters, monkeypatch):
    """A folded family expands per member (float32) or in one block-diagonal product (bf16, where a small product
    costs the same whatever its size): both add the same deltas, forced here in float32 both ways."""
    input_ids = torch.randint(3, 500, (4, 6), generator=torch.Generator().manual_seed(5))
    logits = {}
    for per_member in (True, False):
        monkeypatch.setattr(lora_fused, "per_member_expands", lambda dtype, per_member=per_member: per_member)
        model = _base(tiny_dirs["llama"])
        use_onednn(model)
        registry = LoraRegistry(model)
        registry.load("all", adapters["llama", "all"])
        registry.load("mlp", adapters["llama", "mlp"])
        attn = registry.layers["model.layers.0.self_attn.q_proj"].shared.folded
        mlp = registry.layers["model.layers.0.mlp.up_proj"].shared.folded
        assert (len(attn.expands), len(mlp.expands)) == ((3, 2) if per_member else (1, 1))
        with torch.no_grad():
            registry.set_step(["all", None, "mlp", "all"], [6] * 4)
            logits[per_member] = model(input_ids=input_ids).logits
        registry.clear_step()
        assert attn.calls > 0 and mlp.calls > 0
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=0)
    assert torch.equal(logits[True][1], logits[False][1])  # the base row: exact zeros added either way


# ---- refusals ------------------------------------------------------------------------------------------------


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
    model = _base(tiny_dirs["llama"])
    if message is None:
        load_adapter("x", folder, model)
        return
    with pytest.raises(AdapterError, match=message):
        load_adapter("x", folder, model)


def test_file_refusals(tiny_dirs, adapters, tmp_path):
    model = _base(tiny_dirs["llama"])
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
        load_adapter("x", adapters["llama", "all"], _base(tiny_dirs["qwen2"]))


def test_registry_limits(tiny_dirs, adapters):
    registry = LoraRegistry(_base(tiny_dirs["llama"]), max_loras=2, max_rank=8)
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
    model = _base(tiny_dirs["llama"])
    registry = LoraRegistry(model)
    registry.load("a", adapters["llama", "all"])
    use_onednn(model)  # the wrong order: it replaces the forwards our hooks wrapped
    with pytest.raises(RuntimeError, match="was replaced after its adapter hook"):
        registry.check_hooks()


def test_sync_holds_exactly_the_wanted_set(tiny_dirs, adapters, reference, tmp_path):
    """The shard's side of hot load/unload: the scheduler's whole run-time set, applied as a diff (idempotent, so a
    restarted shard gets the same call); a refused adapter leaves the others loaded; a new generation reloads."""
    registry = LoraRegistry(_base(tiny_dirs["llama"]), max_loras=3, max_rank=16)
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
    torch.testing.assert_close(ours, _peft_logits(reference["llama"], "qv_rs", input_ids), atol=ATOL, rtol=0)
    assert registry.sync({}) == {} and registry.loaded() == []
