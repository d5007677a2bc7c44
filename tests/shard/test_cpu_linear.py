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
