"""The oneDNN linear switch: every plain float32 linear is switched, and the outputs stay torch's up to rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.shard import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN")


def test_switched_linears_compute_the_same(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    gen = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(1, rows, linears[0].in_features, generator=gen) for rows in (1, 3, 4, 17, 64)}
    before = {rows: linears[0](x) for rows, x in inputs.items()}
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=gen)
    with torch.inference_mode():
        logits = model(ids).logits
    assert cpu_linear.use_onednn(model) == len(linears) > 0
    for rows, x in inputs.items():  # the [1, T, in] shape the model passes
        got = linears[0](x)
        assert got.shape == before[rows].shape
        torch.testing.assert_close(got, before[rows], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-3, atol=1e-3)


def test_other_dtypes_keep_torchs_path(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16)
    assert cpu_linear.use_onednn(model) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3"])
def test_fused_projections_equal_separate_ones_bit_for_bit(tiny_dirs, arch):
    """q/k/v and gate/up as one stacked product: the logits are exactly those of the separate products."""
    separate = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    fused = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    linears = sum(type(m) is torch.nn.Linear for m in fused.modules())
    assert cpu_linear.use_onednn(separate, fuse=False) == cpu_linear.use_onednn(fused) == linears
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
    cpu_linear.use_onednn(model)
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(1, 3, attn.q_proj.in_features, generator=gen) for _ in range(2))
    with torch.inference_mode():
        got = [attn.q_proj(a), attn.k_proj(b), attn.v_proj(a), attn.q_proj(a), attn.k_proj(a)]
    want = [a @ weights["q_proj"].T, b @ weights["k_proj"].T, a @ weights["v_proj"].T]
    want += [a @ weights["q_proj"].T, a @ weights["k_proj"].T]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
