"""LoRA adapters: our grouped apply against peft's PeftModel (the reference); the refusals are in
test_lora_refusals.py, the adapters and the reference in tests/lora_adapters.py (built once per session by the
`adapters` / `reference` fixtures of conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.shard.lora import fold, products
from services.shard.lora import registry as lora_registry
from services.shard.lora.adapter import AdapterError
from services.shard.lora.products import STACKED_MAX_TOKENS
from services.shard.lora.registry import LoraRegistry
from services.shard.model.onednn import use_onednn
from tests.lora_adapters import ADAPTERS, ATOL, base_model, peft_logits
from tests.services.shard.lora.test_products import reference_delta


def _registry(model_dir, adapters, arch, onednn: bool, **kwargs) -> LoraRegistry:
    model = base_model(model_dir)
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
        monkeypatch.setattr(products, "STACKED_MAX_TOKENS", 0)
    if form == "grouped by work":  # per-token slots built, but every layer's masked products judged too large
        monkeypatch.setattr(lora_registry, "STACKED_MAX_WORK", 12)
    calls = {"stacked": 0, "grouped": 0, "folded": 0}  # which form each layer ran
    for fn, key in ((lora_registry.expand_stacked, "stacked"), (lora_registry.expand, "grouped")):
        monkeypatch.setattr(
            lora_registry, fn.__name__, lambda *a, fn=fn, key=key: calls.__setitem__(key, calls[key] + 1) or fn(*a)
        )
    product = fold.FoldedProduct.product
    monkeypatch.setattr(
        fold.FoldedProduct, "product", lambda *a: calls.__setitem__("folded", calls["folded"] + 1) or product(*a)
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
        want = peft_logits(reference[arch], name, input_ids[rows])
        torch.testing.assert_close(ours[rows], want, atol=ATOL, rtol=0)
        worst = max(worst, (ours[rows] - want).abs().max().item())
        if name is not None:  # the adapter really changes the output (so the comparison can fail)
            assert (want - peft_logits(reference[arch], None, input_ids[rows])).abs().max() > 1e-1
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
    torch.testing.assert_close(ours[:1], peft_logits(reference["llama"], "all", input_ids[:1]), atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[1:], peft_logits(reference["llama"], "mlp", input_ids[1:]), atol=ATOL, rtol=0)
    registry.load("again", adapters["llama", "qv_rs"])  # into the freed slot
    assert registry.slot_of("again") == 1 and registry.loaded()[1] == "again"
    registry.set_step(["again", None], [10, 10])
    with torch.no_grad():
        ours = registry.model(input_ids=input_ids).logits
    torch.testing.assert_close(ours[:1], peft_logits(reference["llama"], "qv_rs", input_ids[:1]), atol=ATOL, rtol=0)
    registry.clear_step()
    with torch.no_grad():
        base = registry.model(input_ids=input_ids).logits
    torch.testing.assert_close(base, peft_logits(reference["llama"], None, input_ids), atol=ATOL, rtol=0)


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
    model = base_model(tiny_dirs["llama"])
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
            ours[i : i + 1], peft_logits(reference["llama"], name, input_ids[i : i + 1]), atol=ATOL, rtol=0
        )


def test_the_two_expand_forms_give_the_same_logits(tiny_dirs, adapters, monkeypatch):
    """A folded family expands per member (float32) or in one block-diagonal product (bf16, where a small product
    costs the same whatever its size): both add the same deltas, forced here in float32 both ways."""
    input_ids = torch.randint(3, 500, (4, 6), generator=torch.Generator().manual_seed(5))
    logits = {}
    for per_member in (True, False):
        monkeypatch.setattr(fold, "per_member_expands", lambda dtype, per_member=per_member: per_member)
        model = base_model(tiny_dirs["llama"])
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
