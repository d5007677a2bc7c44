"""ModelRunner against transformers' own generate(): greedy output must match token for token.

Each tiny arch runs a small continuous-batching schedule, as the scheduler would drive it: prefills of several
prompts in one step, decodes mixed with later prefills (one of them chunked, with `sample=0` chunks), block
tables grown on demand from a shuffled pool, blocks of finished sequences reused by newcomers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.protocol import codec
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan
from services.shard.model_runner import ModelRunner
from tests.reference import _load, reference_generate
from tests.shard.driver import Request, drive
from tests.tiny_models import ARCHS, EOS, SLIDING_WINDOW
from tests.tiny_models import prompts_for as _prompts

BLOCK_SIZE = {"llama": 16, "qwen2": 4, "gemma2": 16, "gemma3": 4}  # both page sizes get exercised


def _schedule(prompts: list[list[int]]) -> list[Request]:
    return [
        Request(prompts[0], 12, join=1),
        Request(prompts[1], 16, join=1),
        Request(prompts[2], 20, join=3, chunk=16),  # chunked prefill joins running decodes
        Request(prompts[3], 14, join=5),
        Request(prompts[4], 12, join=14),  # joins after others finished, on their freed blocks
        Request(prompts[5], 20, join=2),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = _prompts(model_dir)
    assert max(len(p) for p in prompts) > 5 * SLIDING_WINDOW  # sliding layers really slide
    requests = _schedule(prompts)
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=BLOCK_SIZE[arch])
    got = drive(runner, requests)
    for seq, req in enumerate(requests):
        want = reference_generate(model_dir, req.prompt, req.max_new)
        assert got[seq] == want, f"{arch} seq {seq} (prompt {len(req.prompt)} tokens)"
    if arch == "llama":  # keeps the EOS stop covered (a rebuilt tiny model may need another prompt)
        assert any(out[-1] == EOS and len(out) < r.max_new for out, r in zip(got.values(), requests))


def test_seeded_sampling_is_per_request(tiny_dirs):
    """Same seed → same tokens even when batched together; another seed → other tokens."""
    model_dir = tiny_dirs["llama"]
    prompt = _prompts(model_dir)[1]
    hot = dict(do_sample=True, temperature=3.0)
    requests = [
        Request(prompt, 8, join=1, sampling=SamplingParams(**hot, seed=42)),
        Request(prompt, 8, join=2, sampling=SamplingParams(**hot, seed=42)),
        Request(prompt, 8, join=1, sampling=SamplingParams(**hot, seed=7)),
    ]
    runner = ModelRunner(str(model_dir), num_blocks=32, block_size=8)
    got = drive(runner, requests)
    assert got[0] == got[1]
    assert got[0] != got[2]


def test_plan_errors_and_probe(tiny_dirs):
    runner = ModelRunner(str(tiny_dirs["llama"]), num_blocks=4, block_size=4)
    probe = runner.execute(codec.decode(codec.encode(StepPlan(step=0))))  # a plan with no rows: an empty result
    assert probe.step == 0 and len(probe.seqs) == len(probe.token_ids) == len(probe.logprobs) == 0
    rows = dict(
        seqs=np.array([3], np.int32),
        num_tokens=np.array([6], np.int32),
        context_lens=np.array([0], np.int32),
        token_ids=np.arange(1, 7, dtype=np.int32),
        sample=np.array([1], np.uint8),
    )
    with pytest.raises(ValueError, match="unknown sequence"):
        runner.execute(StepPlan(step=1, **rows))
    with pytest.raises(ValueError, match="blocks"):  # 6 tokens do not fit in one block of 4
        runner.execute(StepPlan(step=1, new=[NewSequence(3, SamplingParams())], blocks={3: [2]}, **rows))
    result = runner.execute(StepPlan(step=2, blocks={3: [0]}, **rows))
    assert result.seqs.tolist() == [3] and result.forward_s > 0


def test_tiny_models_are_sensitive(tiny_dirs):
    """The soft-cap and the sliding window change greedy tokens, so the equality test really checks them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    raw_max = []

    def probe(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scores = torch.matmul(query, repeat_kv(key, module.num_key_value_groups).transpose(2, 3)) * scaling
        raw_max.append(scores.abs().max().item())
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("sy_test_probe", probe)
    model = _load(str(tiny_dirs["gemma2"]))
    cap = model.config.attn_logit_softcapping
    ids = torch.tensor([_prompts(tiny_dirs["gemma2"])[2]])
    with torch.inference_mode():
        model.set_attn_implementation("sy_test_probe")
        try:
            base = model(ids, use_cache=False).logits[0].argmax(-1)
        finally:
            model.set_attn_implementation("eager")
        assert max(raw_max) > cap, f"raw attention scores {max(raw_max):.1f} never reach the soft-cap {cap}"
        for name, value in [("attn_logit_softcapping", None), ("sliding_window", 4096)]:
            old = getattr(model.config, name)
            setattr(model.config, name, value)
            for layer in model.model.layers:  # the attention modules read both at init
                attn = layer.self_attn
                if name == "attn_logit_softcapping":
                    attn.attn_logit_softcapping = value
                elif attn.sliding_window is not None:
                    attn.sliding_window = value
            try:
                changed = model(ids, use_cache=False).logits[0].argmax(-1)
            finally:
                setattr(model.config, name, old)
                for layer in model.model.layers:
                    attn = layer.self_attn
                    if name == "attn_logit_softcapping":
                        attn.attn_logit_softcapping = old
                    elif attn.sliding_window is not None:
                        attn.sliding_window = old
            assert (changed != base).any(), f"gemma2 greedy tokens do not depend on {name}"
