"""Quantized linears: each checkpoint format unpacks to the weights that were packed, each kernel computes the
dense product of its dequantized weights, and a quantized tiny model's log-probs match transformers on its dense
float32 twin.

Tolerances (measured on the tiny models, float32): weight-only kernels differ from the twin only in summation
order, ≤ 3e-5 in any log-prob (WEIGHT_ONLY_TOL = 1e-4). W8A8 also rounds the activations to int8 per token: it
equals an emulation of that rounding to float error, and differs from the unquantized-activation twin by up to
0.45 in log-prob on these deliberately peaked models (W8A8_TOL = 0.75). A wrong packing moves log-probs by
whole units (tested with a shuffled g_idx and AWQ's interleave left out)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.shard.quant import formats as qf
from services.shard.quant import layers as quant_layers
from services.shard.quant import loader as ql
from tests.services.shard.quant.checkpoints import awq_pack, pack_along_cols, pack_along_rows, write

WEIGHT_ONLY_TOL = 1e-4
W8A8_TOL = 0.75
ROWS = (1, 5, 16, 64)


def _weight(n=128, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.25


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_unpacks_what_was_packed(bits, v2):
    qw = qf.quantize_rtn(_weight(), bits, 64, symmetric=False)
    qw.zeros[0, 0] = 0  # the old format stores z − 1: a zero point of 0 wraps to the top level
    stored = qw.zeros.to(torch.int64) if v2 else (qw.zeros.to(torch.int64) - 1) % 2**bits
    got = qf.from_gptq(
        pack_along_rows(qw.levels.t(), bits),
        pack_along_cols(stored.t(), bits),
        qw.scales.t(),
        torch.arange(256, dtype=torch.int32) // 64,
        bits,
        "gptq_v2" if v2 else "gptq",
    )
    assert torch.equal(got.levels, qw.levels) and torch.equal(got.zeros, qw.zeros) and got.g_idx is None
    assert torch.equal(got.dequantize(), qw.dequantize())


def test_awq_unpacks_its_interleaved_order():
    qw = qf.quantize_rtn(_weight(), 4, 32, symmetric=False)
    got = qf.from_awq(awq_pack(qw.levels.t().contiguous()), awq_pack(qw.zeros.to(torch.uint8).t()), qw.scales.t())
    assert torch.equal(got.dequantize(), qw.dequantize())
    plain = pack_along_cols(qw.levels.t().contiguous(), 4)  # the same levels without the interleave
    assert not torch.equal(qf.from_awq(plain, awq_pack(qw.zeros.to(torch.uint8).t()), qw.scales.t()).levels, qw.levels)


@pytest.mark.parametrize("bits, sym", [(4, True), (4, False), (8, True)])
def test_compressed_tensors_pack_quantized_unpacks(bits, sym):
    qw = qf.quantize_rtn(_weight(), bits, 32, symmetric=sym)
    zp = None if sym else (qw.zeros - 2 ** (bits - 1)).to(torch.int8)
    got = qf.from_compressed_packed(pack_along_cols(qw.levels, bits), qw.scales, torch.tensor([128, 256]), bits, zp)
    assert torch.equal(got.dequantize(), qw.dequantize())


def test_int4_packing_reader_matches_torchs():
    levels = torch.randint(0, 16, (192, 256), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    assert (
        quant_layers.reads_int4pack(packed, levels.to(torch.uint8)) in quant_layers.INT4PACK_BLOCKS
    )  # 64 on AVX-512, 32 on AVX2


@pytest.mark.parametrize(
    "n, k, bits, group, sym, kind",
    [
        (128, 256, 4, 32, True, quant_layers.Int4Linear),
        (192, 256, 4, -1, False, quant_layers.Int4Linear),  # one group per row → 256-wide kernel groups, same scale
        (96, 128, 4, 64, False, quant_layers.Int4Linear),  # not a multiple of 64 rows: keeps its own nibble copy
        (128, 256, 4, 16, False, quant_layers.DequantLinear),  # no kernel for groups of 16
        (128, 256, 8, -1, True, quant_layers.Int8Linear),
        (128, 256, 8, 32, False, quant_layers.DequantLinear),
    ],
)
def test_weight_only_layers_compute_the_dequantized_product(n, k, bits, group, sym, kind):
    qw = qf.quantize_rtn(_weight(n, k), bits, group, symmetric=sym, bias=torch.randn(n))
    dense = qw.dequantize()
    for threshold in (None, 1 << 30, 0):  # the shard's choice by rows, the kernel always, the scratch product always
        layer = quant_layers.build(qw, threshold)
        assert type(layer) is kind
        for rows in ROWS:
            x = torch.randn(2, rows, k)
            want = x @ dense.t() + qw.bias
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            got = layer(x.bfloat16())  # bfloat16 activations: the kernels' fast path on CPUs that have it
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_w8a8_rounds_activations_per_token():
    qw = qf.quantize_rtn(_weight(), 8, -1, symmetric=True, act_int8=True)
    layer = quant_layers.build(qw)
    assert type(layer) is quant_layers.W8A8Linear
    for rows in ROWS:
        x = torch.randn(rows, 256) * torch.logspace(-2, 1, rows).unsqueeze(1)  # rows of very different scales
        s = x.abs().amax(-1, keepdim=True) / 127
        emulated = ((x / s).round().clamp(-127, 127) * s) @ qw.dequantize().t()
        torch.testing.assert_close(layer(x), emulated, rtol=1e-5, atol=1e-5 * emulated.abs().max().item())
        assert (layer(x) - x @ qw.dequantize().t()).abs().max() < 0.02 * emulated.abs().max()


def test_w8a8_runs_int_mm_on_its_column_major_weights(monkeypatch):
    """The product is torch._int_mm with the [N, K] int8 weights as a column-major right operand (no [K, N] copy
    resident), alone and fused, at one row and at batch sizes, in both serving dtypes; it still equals the
    emulation of the per-token activation rounding."""
    calls = []
    int_mm = torch._int_mm

    def recording(a, b):
        calls.append((a.dtype, b.dtype, tuple(b.shape), b.stride()))
        return int_mm(a, b)

    monkeypatch.setattr(torch, "_int_mm", recording)
    qw = qf.quantize_rtn(_weight(), 8, -1, symmetric=True, act_int8=True)
    layer = quant_layers.build(qw)
    assert layer.kernel == quant_layers.W8A8Linear.kernel and layer.weight_int8.shape == (128, 256)
    w = qw.dequantize()
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            calls.clear()
            x = (torch.randn(rows, 256) * torch.logspace(-2, 1, rows).unsqueeze(1)).to(dtype)
            xf = x.float()
            s = xf.abs().amax(-1, keepdim=True) / 127
            emulated = ((xf / s).round().clamp(-127, 127) * s) @ w.t()
            got = layer(x)
            assert calls == [(torch.int8, torch.int8, (256, 128), (1, 256))]  # column-major [K, N] view of [N, K]
            assert got.dtype == dtype
            rtol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
            torch.testing.assert_close(got.float(), emulated, rtol=rtol, atol=rtol * emulated.abs().max().item())
    # fused siblings: one call over the stacked rows, each member's columns its own product
    members = [
        quant_layers.build(qf.quantize_rtn(_weight(n, seed=i), 8, -1, True, act_int8=True))
        for i, n in enumerate((64, 32))
    ]
    parent = torch.nn.Module()
    parent.gate_proj, parent.up_proj = members
    assert quant_layers.fuse_w8a8(parent, (("gate_proj", "up_proj"),)) == 2
    product = members[0].fused_product
    assert product.weight_int8.shape == (96, 256) and members[1].weight_int8.data_ptr() == (
        product.weight_int8[64:].data_ptr()
    )
    x = torch.randn(5, 256)
    calls.clear()
    outs = [m(x) for m in members]
    assert calls == [(torch.int8, torch.int8, (256, 96), (1, 256))]
    for m, out in zip(members, outs):
        assert torch.equal(out, quant_layers.W8A8Linear.forward(m, x))


def test_shuffled_group_index_is_caught():
    """desc_act: the same levels with another column→group map are other weights."""
    qw = qf.quantize_rtn(_weight(), 4, 32, symmetric=False)
    qw.g_idx = torch.randperm(256, generator=torch.Generator().manual_seed(1)) // 32
    x = torch.randn(4, 256)
    assert torch.allclose(quant_layers.build(qw)(x), x @ qw.dequantize().t(), atol=1e-4)
    shuffled = qf.QuantWeight(qw.levels, qw.scales, qw.zeros, 4, 32, qw.g_idx[torch.randperm(256)])
    assert not torch.allclose(quant_layers.build(shuffled)(x), x @ qw.dequantize().t(), atol=1e-2)


CHECKPOINTS = {
    "gptq-4bit-sym-g32": ("gptq", dict(bits=4, group=32, sym=True)),
    "gptq-4bit-asym-rowwise-v2": ("gptq", dict(bits=4, group=-1, sym=False, v2=True)),
    "gptq-4bit-desc_act": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True)),
    "gptq-8bit-desc_act": ("gptq", dict(bits=8, group=32, sym=False, desc_act=True)),
    "awq": ("awq", dict(group=32, sym=False)),
    "ct-w4a16-asym": ("compressed-tensors", dict(bits=4, group=32, sym=False)),
    "ct-w8a16": ("compressed-tensors", dict(bits=8, group=-1, sym=True)),
}


def _logprobs(model, ids):
    with torch.inference_mode():
        return torch.log_softmax(model(ids).logits.float(), -1)


def _ids(model_dir, n=24):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_checkpoint_logprobs_match_the_dense_twin(tiny_dirs, tmp_path, arch, case):
    fmt, kw = CHECKPOINTS[case]
    out = write(tiny_dirs[arch], tmp_path, fmt, **kw)
    quant = ql.from_pretrained(str(out / "quant"), fmt, dtype=torch.float32).eval()
    twin = AutoModelForCausalLM.from_pretrained(out / "twin", dtype=torch.float32).eval()
    assert any(isinstance(m, quant_layers.QuantLinear) for m in quant.modules())
    ids = _ids(out / "twin")
    for rows in (1, 3, 24):  # decode-sized (the kernels) and prefill-sized (dequantized scratch)
        a, b = _logprobs(quant, ids[:, :rows]), _logprobs(twin, ids[:, :rows])
        assert (a - b).abs().max() < WEIGHT_ONLY_TOL
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_compressed_tensors_w8a8_checkpoint(tiny_dirs, tmp_path):
    out = write(tiny_dirs["llama"], tmp_path, "compressed-tensors-w8a8")
    quant = ql.from_pretrained(str(out / "quant"), "compressed-tensors", dtype=torch.float32).eval()
    assert isinstance(quant.model.layers[0].mlp.down_proj, quant_layers.W8A8Linear)
    twin = AutoModelForCausalLM.from_pretrained(out / "twin", dtype=torch.float32).eval()
    ids = _ids(out / "twin")
    assert (_logprobs(quant, ids) - _logprobs(twin, ids)).abs().max() < W8A8_TOL


def test_a_wrong_group_index_in_the_file_fails_the_twin_check(tiny_dirs, tmp_path):
    out = write(tiny_dirs["llama"], tmp_path, "gptq", bits=4, group=32, sym=False, desc_act=True)
    path = out / "quant" / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(3)
    for key in [k for k in tensors if k.endswith(".g_idx")]:
        tensors[key] = tensors[key][torch.randperm(len(tensors[key]), generator=gen)].contiguous()
    save_file(tensors, str(path))
    quant = ql.from_pretrained(str(out / "quant"), "gptq", dtype=torch.float32).eval()
    twin = AutoModelForCausalLM.from_pretrained(out / "twin", dtype=torch.float32).eval()
    ids = _ids(out / "twin")
    assert (_logprobs(quant, ids) - _logprobs(twin, ids)).abs().max() > 100 * WEIGHT_ONLY_TOL


@pytest.mark.parametrize(
    "method, kind, tol",
    [("eetq", quant_layers.W8A8Linear, W8A8_TOL), ("bitsandbytes-nf4", quant_layers.Int4Linear, WEIGHT_ONLY_TOL)],
)
def test_quantized_at_load(tiny_dirs, method, kind, tol):
    """On the fly: every linear but the LM head is swapped; the twin is the float model with each layer's weights
    replaced by their dequantized round-to-nearest values."""
    twin = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    quant = ql.from_pretrained(str(tiny_dirs["llama"]), method, dtype=torch.float32).eval()
    layers = {n: m for n, m in quant.named_modules() if isinstance(m, quant_layers.QuantLinear)}
    assert len(layers) == 7 * quant.config.num_hidden_layers and all(type(m) is kind for m in layers.values())
    assert type(quant.lm_head) is torch.nn.Linear
    with torch.no_grad():
        for name, layer in layers.items():
            dense = twin.get_submodule(name)
            dense.weight.copy_(layer.dequantize_into(torch.empty_like(dense.weight)))
    ids = _ids(tiny_dirs["llama"])
    assert (_logprobs(quant, ids) - _logprobs(twin, ids)).abs().max() < tol


@pytest.mark.parametrize(
    "arch, case",
    [("llama", "gptq-4bit-desc_act"), ("gemma3", "awq"), ("qwen2", "ct-w4a16-asym"), ("gemma2", "ct-w8a16")],
)
def test_the_runner_serves_a_quantized_checkpoint_like_its_twin(tiny_dirs, tmp_path, arch, case):
    """ModelRunner(quantize=…) over a mixed batch (whole and chunked prefills joining decodes): the prompt
    log-probs equal a plain transformers forward of the dense twin, the greedy tokens its generate()."""
    from bench.engine import Engine, request
    from services.shard.model_runner import ModelRunner
    from tests.reference import reference_generate
    from tests.services.shard.test_model_runner import Steps
    from tests.services.shard.test_model_runner_logprobs import reference_prompt_logprobs
    from tests.tiny_models import prompts_for

    fmt, kw = CHECKPOINTS[case]
    out = write(tiny_dirs[arch], tmp_path, fmt, **kw)
    prompts = prompts_for(out / "twin")
    arrivals = {
        0: [request("0", prompts[2], 5, prompt_logprobs=True), request("1", prompts[1], 6, prompt_logprobs=True)],
        2: [request("2", prompts[4], 4, prompt_logprobs=True)],
        3: [request("3", prompts[0], 4)],
    }
    runner = ModelRunner(str(out / "quant"), num_blocks=96, block_size=4, quantize=fmt)
    assert any(isinstance(m, quant_layers.QuantLinear) for m in runner.model.modules())
    # the first prompt whole and 5 tokens of the second in one step; then chunks of up to 16 beside the decodes
    engine = Engine.build(runner, out / "quant", max_batch_prefill_tokens=63, max_prefill_tokens_while_decoding=16)
    steps = Steps(engine)
    got = engine.run(arrivals)
    assert steps.chunks("0") == [len(prompts[2])] and len(steps.chunks("1")) > 1 and steps.beside_decodes("2")
    for req in (r for reqs in arrivals.values() for r in reqs):
        rid, prompt = req.request_id, req.input_ids.tolist()
        assert got[rid].tokens == reference_generate(out / "twin", prompt, req.max_new_tokens), f"request {rid}"
        if req.sampling.prompt_logprobs:
            have = np.array(got[rid].prompt_logprobs, dtype=np.float32)[1:]  # as the scheduler gathered the runs
            want = np.array(reference_prompt_logprobs(out / "twin", prompt), dtype=np.float32)[1:]
            np.testing.assert_allclose(have, want, rtol=0, atol=2e-4 + WEIGHT_ONLY_TOL, err_msg=f"request {rid}")


def test_lora_adapters_over_a_quantized_base(tiny_dirs, tmp_path):
    """The LoRA registry wraps quantized layers like dense ones: a mixed batch of base and adapter rows over the
    int4 model equals the same registry over its dense twin."""
    pytest.importorskip("peft")
    from services.shard.lora.registry import LoraRegistry
    from tests.lora_adapters import ADAPTERS, build_adapter

    names = ("all", "mlp")
    folders = {n: build_adapter(tiny_dirs["llama"], tmp_path / n, seed=i, **ADAPTERS[n]) for i, n in enumerate(names)}
    quant = ql.from_pretrained(str(tiny_dirs["llama"]), "bitsandbytes-nf4", dtype=torch.float32).eval()
    twin = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        for name, layer in quant.named_modules():
            if isinstance(layer, quant_layers.QuantLinear):
                dense = twin.get_submodule(name)
                dense.weight.copy_(layer.dequantize_into(torch.empty_like(dense.weight)))
    rows = [None, "all", "mlp", "all"]
    ids = torch.randint(3, 500, (len(rows), 12), generator=torch.Generator().manual_seed(7))
    logits = []
    for model in (quant, twin):
        registry = LoraRegistry(model)
        for n in names:
            registry.load(n, folders[n])
        registry.check_hooks()
        registry.set_step(rows, [12] * len(rows))
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
        registry.clear_step()
    assert (logits[0] - logits[1]).abs().max() < 1e-3
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        assert (logits[0][1] - base(input_ids=ids[1:2]).logits[0]).abs().max() > 1e-1  # the adapter is applied


def test_a_layer_missing_from_the_checkpoint_is_an_error(tiny_dirs, tmp_path):
    out = write(tiny_dirs["llama"], tmp_path, "awq", group=32, sym=False)
    path = out / "quant" / "model.safetensors"
    tensors = load_file(str(path))
    for suffix in ("qweight", "qzeros", "scales"):
        del tensors[f"model.layers.1.mlp.up_proj.{suffix}"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="`model.layers.1.mlp.up_proj` is neither quantized nor stored"):
        ql.from_pretrained(str(out / "quant"), "awq", dtype=torch.float32)


def test_w8a8_siblings_share_one_product_with_the_same_columns(tiny_dirs):
    """q/k/v and gate/up quantized at load run as one activation quantization and one int8 product per group; each
    member's columns equal its own product bit for bit, and the model's logits are unchanged by the fusion."""
    model = ql.from_pretrained(str(tiny_dirs["llama"]), "eetq", dtype=torch.float32)
    layer = model.model.layers[0]
    members = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    assert all(m.fused_product is members[0].fused_product for m in members)
    assert layer.mlp.gate_proj.fused_product is layer.mlp.up_proj.fused_product
    assert not hasattr(layer.self_attn.o_proj, "fused_product")
    x = torch.randn(5, members[0].in_features)
    for m in members:
        alone = quant_layers.W8A8Linear.forward(m, x)  # the class's own per-layer product
        assert torch.equal(m(x), alone)
    fused_bytes = sum(ql.resident_bytes(m) for m in members)
    assert (
        fused_bytes
        == members[0].fused_product.weight_int8.numel() + 4 * members[0].fused_product.channel_scales.numel()
    )
