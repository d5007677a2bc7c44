"""ModelRunner.from_config: a model built in memory from a config (random weights, fixed seed), no folder.

A tiny Llama built so serves, through the in-process engine (staggered joins, a chunked prefill), the greedy tokens
transformers' own generate() gives on the same weights (rebuilt from the same seed); the weights are made on the
device the runner asks for (the meta device here stands for a GPU: nothing is materialized on the host).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner

SEED = 7


def tiny_config() -> LlamaConfig:
    # a large init std gives peaked logits: greedy choices by clear margins, not float noise
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.25,
        eos_token_id=2,
        bos_token_id=1,
    )


def reference(prompt: list[int], max_new: int) -> list[int]:
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def test_in_memory_model_serves_generate_tokens():
    runner = ModelRunner.from_config(tiny_config(), num_blocks=32, block_size=4, seed=SEED)
    assert runner.grammars.constraints is None and runner.model.config.eos_token_id == 2
    torch.manual_seed(SEED)
    again = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    for name, p in again.state_dict().items():  # the seed fixes the weights
        assert torch.equal(p, runner.model.state_dict()[name]), name

    prompts = [[1, 5, 9, 33, 70], [1] + list(range(40, 80)), [1, 200, 17, 3]]
    engine = Engine.build(runner, None, eos_ids=set(), max_batch_prefill_tokens=24)
    arrivals = {0: [request("a", prompts[0], 12), request("b", prompts[1], 12)], 3: [request("c", prompts[2], 12)]}
    outputs = engine.run(arrivals)
    for rid, prompt in zip("abc", prompts):
        assert outputs[rid].tokens == reference(prompt, 12), rid


def test_weights_are_made_on_the_device():
    runner = ModelRunner.from_config(tiny_config(), num_blocks=4, dtype=torch.bfloat16, device="meta")
    assert {p.device.type for p in runner.model.parameters()} == {"meta"}
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
