"""LoRA through the ModelRunner (paged attention, fused oneDNN linears, its own registry loaded at start), on
every tiny architecture: greedy output equals peft's own generate() (PeftModel with that adapter active, float32,
eager attention) token for token, over a continuous-batching schedule (driven by the in-process engine,
bench/engine.py) that mixes base rows and two adapters in its steps: a first step of prefills over 64 tokens (made
the grouped products' size here), decode steps (the stacked form), a chunked prefill joining running decodes, and
KV for fewer blocks than the requests take in all, so that a later joiner runs on blocks finished requests held.
The e2e tests serve Qwen2 (test_lora.py) and Gemma-3 (test_lora_archs.py) through the whole server; this is where
Llama's MHA, Gemma-2's soft-caps and sliding window and Gemma-3's q/k norms meet the adapters, one server cheaper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine import Engine, request
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan
from services.shard.lora import products
from services.shard.model_runner import ModelRunner
from tests.lora_adapters import (
    ADAPTERS,
    ATOL,
    base_model,
    build_adapter,
    peft_logits,
)
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import ARCHS, prompts_for

peft = pytest.importorskip("peft")

ARCH_ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "qv_mlp_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
}
MAX_NEW = 8


def _arrivals(prompts: list[list[int]]) -> dict[int, list]:
    """Requests by the step they arrive before, named by their adapter (None: the base model) and prompt."""

    def req(adapter: str | None, i: int):
        return request(f"{adapter} {i}", prompts[i], MAX_NEW, adapter=adapter)

    return {
        0: [req("all", 1), req(None, 2), req("qv_mlp_rs", 4)],
        1: [req("all", 3)],  # chunks of 8 joining the decodes
        2: [req("qv_mlp_rs", 0)],
        11: [req(None, 5)],  # after others finished, on blocks they held
    }


def _peft_generate(ref, adapter: str | None, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    with torch.inference_mode():
        if adapter is None:
            with ref.disable_adapter():
                return ref.generate(input_ids=ids, **kwargs)[0, len(prompt) :].tolist()
        ref.set_adapter(adapter)
        return ref.generate(input_ids=ids, **kwargs)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_adapters_equals_peft_generate(tiny_dirs, tmp_path, arch, monkeypatch):
    model_dir = tiny_dirs[arch]
    folders = {n: build_adapter(model_dir, tmp_path / n, seed=50 + i, **cfg) for i, (n, cfg) in
               enumerate(ARCH_ADAPTERS.items())}  # fmt: skip
    arrivals = _arrivals(prompts_for(model_dir))
    requests = [r for reqs in arrivals.values() for r in reqs]
    monkeypatch.setattr(products, "STACKED_MAX_TOKENS", 64)  # the first step's prefills take the grouped form
    assert sum(len(r.input_ids) for r in arrivals[0]) > products.STACKED_MAX_TOKENS
    runner = ModelRunner(str(model_dir), num_blocks=52, block_size=4, lora_adapters={n: str(f) for n, f in
                         folders.items()})  # fmt: skip
    forms, forward = [], runner._forward

    def record(batch):
        groups = runner.lora.step_groups
        forms.append(None if groups is None else groups.token_slots is not None)
        return forward(batch)

    runner._forward = record
    engine = Engine.build(runner, model_dir, max_prefill_tokens_while_decoding=8)
    steps = Steps(engine)
    got = engine.run(arrivals)
    assert True in forms and False in forms  # stacked steps and grouped steps both ran
    assert len(steps.chunks("all 3")) > 1 and steps.beside_decodes("all 3") and "None 5" in steps.reused
    ref = peft.PeftModel.from_pretrained(base_model(model_dir), folders["all"], adapter_name="all")
    ref.load_adapter(folders["qv_mlp_rs"], adapter_name="qv_mlp_rs")
    ref.eval()
    for req in requests:
        want = _peft_generate(ref, req.adapter, req.input_ids.tolist())
        assert got[req.request_id].tokens == want, f"{arch} request {req.request_id}"
    prompt = requests[0].input_ids.tolist()  # the adapters really change this prompt's answer, so equality can fail
    assert len({tuple(_peft_generate(ref, a, prompt)) for a in (None, *ARCH_ADAPTERS)}) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_prefill_through_the_runner(tiny_dirs, adapters, reference, arch):
    """A plan's new sequences name their adapters; the runner (paged attention, fused oneDNN linears, its own
    registry loaded at start) groups the packed rows in prepare and clears the grouping after the forward."""
    folders = {name: str(adapters[arch, name]) for name in ADAPTERS}
    runner = ModelRunner(str(tiny_dirs[arch]), num_blocks=32, block_size=4, lora_adapters=folders)
    assert runner.lora.loaded() == list(ADAPTERS)
    rows = ["mlp", None, "all", "qv_rs", "all", "regex"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 9, 3, 11, 7, 6)]
    need = [-(-len(p) // 4) for p in prompts]
    starts = np.cumsum([0] + need)
    plan = StepPlan(
        step=1,
        new=[NewSequence(i, SamplingParams(), [], rows[i]) for i in range(len(rows))],
        blocks={i: list(range(starts[i], starts[i + 1])) for i in range(len(rows))},
        seqs=np.arange(len(rows), dtype=np.int32),
        num_tokens=np.array([len(p) for p in prompts], np.int32),
        context_lens=np.zeros(len(rows), np.int32),
        token_ids=np.array([t for p in prompts for t in p], np.int32),
        sample=np.ones(len(rows), np.uint8),
    )
    seen = []  # the logits of the runner's own forward, and the grouping it ran with
    forward = runner._forward
    runner._forward = lambda batch: seen.append((forward(batch), runner.lora.step_groups)) or seen[-1][0]
    result = runner.execute(plan)
    last, groups = seen[0]
    assert sorted(slot for slot, _ in groups.groups) == sorted({runner.lora.slot_of(r) for r in rows if r})
    assert runner.lora.step_groups is None  # cleared after the forward
    for i, (name, prompt) in enumerate(zip(rows, prompts)):
        want = peft_logits(reference[arch], name, torch.tensor([prompt]))[0, -1]
        torch.testing.assert_close(last[i], want, atol=ATOL, rtol=0)
        assert result.token_ids[i] == int(want.argmax())
    # a base-only step sets no grouping at all
    base = StepPlan(
        step=2,
        new=[NewSequence(9, SamplingParams())],
        blocks={9: [starts[-1]]},
        seqs=np.array([9], np.int32),
        num_tokens=np.array([3], np.int32),
        context_lens=np.zeros(1, np.int32),
        token_ids=np.array([5, 6, 7], np.int32),
        sample=np.ones(1, np.uint8),
    )
    runner.execute(base)
    assert seen[-1][1] is None
    unknown = StepPlan(step=3, new=[NewSequence(10, SamplingParams(), [], "nope")], **_no_rows())
    with pytest.raises(ValueError, match="LoRA adapter 'nope', which this shard has not loaded"):
        runner.execute(unknown)


def _no_rows() -> dict:
    empty = np.zeros(0, np.int32)
    return dict(seqs=empty, num_tokens=empty, context_lens=empty, token_ids=empty, sample=np.zeros(0, np.uint8))
