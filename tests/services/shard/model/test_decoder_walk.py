"""The direct decoder walk (services/shard/model/decoder_walk.py) against transformers: same tokens as generate(), the
same logits as transformers' forward through the same runner (bit for bit in float32; bf16 within its rounding), the
runner driven by the in-process engine (bench/engine.py); and the models it does not know keep transformers'
forward, with the reason on the runner."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, request
from libs.runtime.settings import Settings
from services.shard.model.decoder_walk import unsupported
from services.shard.model_runner import ModelRunner
from tests.reference import reference_generate
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import ARCHS, SLIDING_WINDOW, prompts_for

BLOCK_SIZE = {"llama": 4, "qwen2": 16, "gemma2": 4, "gemma3": 16}


def _arrivals(prompts: list[list[int]]) -> dict[int, list]:
    """Prompts several sliding windows long, prefilled in several chunks, decoding beside later prefills."""
    return {
        0: [request("41", prompts[1], 12), request("58", prompts[2], 10)],  # 58 tokens: 16, then chunks of 9
        1: [request("47", prompts[4], 8)],  # chunks of 9, joining running decodes
        3: [request("17", prompts[3], 9)],
    }


def _logits_of(runner: ModelRunner) -> list[torch.Tensor]:
    """Every step's [kept, vocab] logits, recorded as the runner's forward returns them."""
    seen, forward = [], runner._forward

    def recording(batch):
        logits = forward(batch)
        seen.append(logits.float().clone())
        return logits

    runner._forward = recording
    return seen


def _run(model_dir, dtype: torch.dtype, walk: bool, arch: str):
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=BLOCK_SIZE[arch], dtype=dtype, decoder_walk=walk)
    logits = _logits_of(runner)
    # 57 prompt tokens a step, 9 while anything decodes
    engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=57, max_prefill_tokens_while_decoding=9)
    steps = Steps(engine)
    got = engine.run(_arrivals(prompts_for(model_dir)))
    assert len(steps.chunks("58")) > 3 and len(steps.chunks("47")) > 3 and steps.beside_decodes("47")
    return runner, {rid: out.tokens for rid, out in got.items()}, logits


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_walk_matches_transformers_in_float32(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    requests = [r for reqs in _arrivals(prompts_for(model_dir)).values() for r in reqs]
    assert max(len(r.input_ids) for r in requests) > 5 * SLIDING_WINDOW
    walked, got, walk_logits = _run(model_dir, torch.float32, True, arch)
    assert walked.walk is not None and walked.walk_reason == ""
    assert walked.walk.forwards == len(walk_logits) > 10  # every step went through the walk
    for req in requests:
        want = reference_generate(model_dir, req.input_ids.tolist(), req.max_new_tokens)
        assert got[req.request_id] == want, f"{arch} request {req.request_id}"
    plain, plain_got, plain_logits = _run(model_dir, torch.float32, False, arch)
    assert plain.walk is None and plain.walk_reason == "turned off"
    assert plain_got == got
    assert len(plain_logits) == len(walk_logits)
    for step, (a, b) in enumerate(zip(walk_logits, plain_logits)):
        assert torch.equal(a, b), f"{arch} step {step}: max diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decoder_walk_in_bf16_is_within_its_rounding(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    walked, got, walk_logits = _run(model_dir, torch.bfloat16, True, arch)
    _, plain_got, plain_logits = _run(model_dir, torch.bfloat16, False, arch)
    assert walked.walk is not None and walked.walk.forwards == len(walk_logits)
    assert len(plain_logits) == len(walk_logits)
    for a, b in zip(walk_logits, plain_logits):
        # a few bf16 ulps of the logit's size: what rounding differences through the layers could leave
        assert ((a - b).abs() <= 4 * 2**-8 * b.abs().clamp(min=1)).all()
    agree = sum(x == y for x, y in zip(got.values(), plain_got.values()))
    assert agree >= len(got) - 1  # greedy picks may part only at a near tie


def test_models_the_walk_does_not_know_keep_transformers(tiny_dirs):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)
    qwen3 = AutoModelForCausalLM.from_config(Qwen3Config(**small, num_attention_heads=4, num_key_value_heads=2))
    assert "Qwen3ForCausalLM has no decoder walk" in unsupported(qwen3)
    bidirectional = Gemma3TextConfig(**small, num_attention_heads=4, num_key_value_heads=2)
    bidirectional.use_bidirectional_attention = True
    assert unsupported(AutoModelForCausalLM.from_config(bidirectional)) == "bidirectional attention"
    llama = ModelRunner(str(tiny_dirs["llama"]), num_blocks=8, block_size=4)
    assert unsupported(llama.model) == "" and unsupported(llama.model, tp=2).startswith("tensor parallel")
    plain = ModelRunner(str(tiny_dirs["llama"]), num_blocks=32, block_size=4, decoder_walk=False)
    prompt = prompts_for(tiny_dirs["llama"])[1]
    got = Engine.build(plain, tiny_dirs["llama"]).run({0: [request("p", prompt, 6)]})["p"].tokens
    assert got == reference_generate(tiny_dirs["llama"], prompt, 6)
    assert plain.walk is None


def test_the_environment_turns_the_walk_off(tiny_dirs, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_DECODER_WALK", "0")  # Settings.decoder_walk, as the shard hands it to its runner
    runner = ModelRunner(
        str(tiny_dirs["gemma3"]), num_blocks=8, block_size=4, decoder_walk=Settings.from_env().decoder_walk
    )
    assert runner.walk is None and runner.walk_reason == "turned off"


def test_an_unknown_decoder_layer_keeps_transformers(tiny_dirs):
    """A layer class that is not transformers' own (remote code, a patched model) is not walked."""
    runner = ModelRunner(str(tiny_dirs["qwen2"]), num_blocks=8, block_size=4)
    layer = runner.model.model.layers[0]
    layer.__class__ = type("Qwen2DecoderLayer", (type(layer),), {"__module__": "somewhere.else"})
    assert "is not transformers' own" in unsupported(runner.model)
