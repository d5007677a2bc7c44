"""The oneDNN linear switch: every plain float32 (and, where oneDNN runs it, bfloat16) linear is switched, and the
outputs stay torch's up to rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.shard.model import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="torch built without oneDNN")


def test_switched_linears_compute_the_same(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    gen = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(1, rows, linears[0].in_features, generator=gen) for rows in (1, 3, 4, 17, 64)}
    before = {rows: linears[0](x) for rows, x in inputs.items()}
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=gen)
    with torch.inference_mode():
        logits = model(ids).logits
    assert onednn.use_onednn(model) == len(linears) > 0
    for rows, x in inputs.items():  # the [1, T, in] shape the model passes
        got = linears[0](x)
        assert got.shape == before[rows].shape
        torch.testing.assert_close(got, before[rows], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-3, atol=1e-3)


def test_float32_products_are_the_prepacked_kernel_bit_for_bit(tiny_dirs):
    """float32 stays exactly what it was: each switched linear returns oneDNN's product of the packed weight."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    down = model.model.layers[0].mlp.down_proj
    packed = torch.ops.mkldnn._reorder_linear_weight(down.weight.detach().clone(), onednn.PACK_FOR_BATCH)
    onednn.use_onednn(model)
    x = torch.randn(1, 7, down.in_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = torch.ops.mkldnn._linear_pointwise(x[0], packed, None, "none", [None], "")
        assert down(x).dtype == torch.float32
        assert torch.equal(down(x)[0], want)


@pytest.mark.skipif(not onednn.dtype_supported(torch.bfloat16), reason="oneDNN runs no bf16 on this CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_bf16_linears_are_switched_and_match_torchs_bf16(tiny_dirs, arch):
    """The serving dtype takes the oneDNN path too (fused q/k/v, gate/up, the tied LM head) and its numbers are
    torch's bf16 linear's within bf16 rounding."""
    torchs = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.bfloat16).eval()
    ours = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.bfloat16).eval()
    linears = [m for m in ours.modules() if type(m) is torch.nn.Linear]
    assert onednn.use_onednn(ours) == len(linears) > 0
    assert ours.model.layers[0].self_attn.q_proj.fused_product is ours.model.layers[0].self_attn.v_proj.fused_product
    assert "forward" in vars(ours.lm_head)  # the LM head is switched too (its own forward replaces nn.Linear's)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 5, linears[0].in_features, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        got = linears[0](x)
        assert got.dtype == torch.bfloat16
        want = torch.nn.functional.linear(x, linears[0].weight, linears[0].bias)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        for rows in (1, 6):
            ids = torch.randint(3, ours.config.vocab_size, (1, rows), generator=gen)
            want, have = torchs(ids).logits.float(), ours(ids).logits.float()
            torch.testing.assert_close(have, want, rtol=3e-2, atol=3e-2)
            assert (have.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_a_dtype_onednn_cannot_run_keeps_torchs_path(tiny_dirs, monkeypatch):
    """float16 is not taken, and bf16 falls back whole where the probe found oneDNN unable (AVX2-only CPUs)."""
    half = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float16)
    assert not onednn.dtype_supported(torch.float16)
    assert onednn.use_onednn(half) == 0
    monkeypatch.setitem(onednn._supported, torch.bfloat16, False)  # what the probe records on such a CPU
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16)
    assert onednn.use_onednn(bf16) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3"])
def test_fused_projections_equal_separate_ones_bit_for_bit(tiny_dirs, arch):
    """q/k/v and gate/up as one stacked product: the logits are exactly those of the separate products."""
    separate = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    fused = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    linears = sum(type(m) is torch.nn.Linear for m in fused.modules())
    assert onednn.use_onednn(separate, fuse=False) == onednn.use_onednn(fused) == linears
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert attn.q_proj.fused_product is attn.k_proj.fused_product is attn.v_proj.fused_product
    assert mlp.gate_proj.fused_product is mlp.up_proj.fused_product is not attn.q_proj.fused_product
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 5, 33):
        ids = torch.randint(3, fused.config.vocab_size, (1, rows), generator=gen)
        with torch.inference_mode():
            assert torch.equal(fused(ids).logits, separate(ids).logits)


def test_a_member_called_with_another_input_computes_its_own(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    weights = {n: getattr(attn, n).weight.detach().clone() for n in ("q_proj", "k_proj", "v_proj")}
    onednn.use_onednn(model)
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(1, 3, attn.q_proj.in_features, generator=gen) for _ in range(2))
    with torch.inference_mode():
        got = [attn.q_proj(a), attn.k_proj(b), attn.v_proj(a), attn.q_proj(a), attn.k_proj(a)]
    want = [a @ weights["q_proj"].T, b @ weights["k_proj"].T, a @ weights["v_proj"].T]
    want += [a @ weights["q_proj"].T, a @ weights["k_proj"].T]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
