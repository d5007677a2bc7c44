"""ModelRunner against transformers' own generate(): greedy output must match token for token.

Each tiny arch is driven by the in-process engine (bench/engine.py: the scheduler's Batcher and this runner, the
plans and results encoded as on the bus) through a small continuous-batching schedule: prefills of several
prompts in one step, decodes mixed with later prefills (the longest one chunked, with `sample=0` chunks), block
tables grown on demand, and KV for fewer blocks than the requests take in all, so that the last joiner runs on
blocks that finished requests held (their stale KV must not leak).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from bench.engine import Engine, request
from libs.protocol import codec
from libs.protocol.messages import FINISH_EOS
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan, StepResult
from services.shard.model_runner import ModelRunner
from tests.reference import load_model, reference_generate
from tests.tiny_models import ARCHS, EOS, SLIDING_WINDOW
from tests.tiny_models import prompts_for as _prompts

BLOCK_SIZE = {"llama": 16, "qwen2": 4, "gemma2": 16, "gemma3": 4}  # both page sizes get exercised
# KV for fewer blocks than the schedule's requests take in all, enough for those running at once
NUM_BLOCKS = {"llama": 18, "qwen2": 64, "gemma2": 18, "gemma3": 64}


@dataclass
class Row:
    rid: str  # the request it feeds
    fed: int  # tokens fed
    context: int  # tokens before them
    prompt: bool  # a (chunk of the) prefill, not a decode


class Steps:
    """An engine's on_step (set here): each step's rows and row errors, the request of each handle, and the
    requests that got a block a finished request held, so that a test can show its schedule did what it says.
    Checks each result against its plan, as the scheduler relies on it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: list[list[Row]] = []
        self.errors: list[dict[str, str]] = []  # per step: request id → the error its row reported
        self.rid: dict[int, str] = {}  # handle → request id
        self.reused: set[str] = set()
        self._holder: dict[int, str] = {}  # block → the last request it was handed to
        engine.on_step = self

    def __call__(self, plan: StepPlan, result: StepResult) -> None:
        running = self.engine.batcher.running
        self.rid.update((seq, running[seq].req.request_id) for seq in plan.seqs.tolist())
        rows = zip(plan.seqs.tolist(), plan.num_tokens.tolist(), plan.context_lens.tolist())
        self.rows.append([Row(self.rid[s], n, ctx, ctx < len(running[s].req.input_ids)) for s, n, ctx in rows])
        for seq, blocks in plan.blocks.items():
            rid = running[seq].req.request_id
            for b in blocks:
                held = self._holder.get(b, rid)
                if held != rid and self.engine.outputs[held].finish:
                    self.reused.add(rid)
                self._holder[b] = rid
        self.errors.append({self.rid[seq]: error for seq, error in result.errors.items()})
        assert result.step == plan.step and result.seqs.tolist() == plan.seqs[plan.sample == 1].tolist()
        assert result.token_ids.dtype == np.int32 and (result.logprobs <= 0).all()

    def chunks(self, rid: str) -> list[int]:
        """Tokens fed by each prompt row of a request."""
        return [r.fed for rows in self.rows for r in rows if r.rid == rid and r.prompt]

    def beside_decodes(self, rid: str) -> bool:
        """Whether a prompt row of a request ran in a step with decode rows."""
        return any(
            any(r.rid == rid and r.prompt for r in rows) and any(not r.prompt for r in rows) for rows in self.rows
        )


def _arrivals(prompts: list[list[int]]) -> dict[int, list]:
    """Requests by the step they arrive before (0: the first), named by their prompt."""
    return {
        0: [request("0", prompts[0], 12), request("1", prompts[1], 16)],  # prefilled in one step
        1: [request("5", prompts[5], 20)],
        2: [request("2", prompts[2], 20)],  # chunks of 16 beside the running decodes
        4: [request("3", prompts[3], 14)],
        13: [request("4", prompts[4], 12)],  # after others finished, on blocks they held
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = _prompts(model_dir)
    assert max(len(p) for p in prompts) > 5 * SLIDING_WINDOW  # sliding layers really slide
    arrivals = _arrivals(prompts)
    runner = ModelRunner(str(model_dir), num_blocks=NUM_BLOCKS[arch], block_size=BLOCK_SIZE[arch])
    engine = Engine.build(runner, model_dir, max_prefill_tokens_while_decoding=16)
    steps = Steps(engine)
    got = engine.run(arrivals)
    requests = [r for reqs in arrivals.values() for r in reqs]
    for req in requests:
        want = reference_generate(model_dir, req.input_ids.tolist(), req.max_new_tokens)
        assert got[req.request_id].tokens == want, f"{arch} request {req.request_id} ({len(req.input_ids)} tokens)"
    assert sum(r.prompt for r in steps.rows[0]) == 2  # several prompts in one step
    assert len(steps.chunks("2")) > 2 and steps.beside_decodes("2")  # a chunked prefill beside decodes
    assert "4" in steps.reused  # the last joiner's blocks held finished requests' KV
    if arch == "llama":  # keeps the EOS stop covered (a rebuilt tiny model may need another prompt)
        assert any(out.finish == FINISH_EOS and out.tokens[-1] == EOS for out in got.values())


def test_seeded_sampling_is_per_request(tiny_dirs):
    """Same seed → same tokens even when batched together (the later one from the first one's cached prefix);
    another seed → other tokens."""
    model_dir = tiny_dirs["llama"]
    prompt = _prompts(model_dir)[1]
    hot = dict(do_sample=True, temperature=3.0)
    arrivals = {
        0: [request("a", prompt, 8, **hot, seed=42), request("other", prompt, 8, **hot, seed=7)],
        1: [request("b", prompt, 8, **hot, seed=42)],
    }
    runner = ModelRunner(str(model_dir), num_blocks=32, block_size=8)
    got = Engine.build(runner, model_dir).run(arrivals)
    assert got["a"].tokens == got["b"].tokens
    assert got["a"].tokens != got["other"].tokens


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
    model = load_model(str(tiny_dirs["gemma2"]))
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
