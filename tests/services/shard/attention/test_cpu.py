"""The CPU backend through the runner and the in-process engine, in bf16 on every tiny architecture: the decoder
walk with the C++ kernels is as close to float32 as the same walk with torch's ops, teacher-forced; prefill chunks
beside decodes split between the kernel (short rows) and the torch ops (the chunk); verified drafts give the tokens
the decodes give; float32, the exact mode, never takes the kernels."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, request
from libs.protocol.params import SamplingParams
from services.shard.attention import cpu
from services.shard.attention.paged import PagedBatch
from services.shard.model.decoder_walk import DecoderWalk
from services.shard.model_runner import ModelRunner
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import ARCHS, SLIDING_WINDOW, prompts_for

MAX_NEW = 12


def _runner(model_dir, kernels: bool, dtype=torch.bfloat16) -> ModelRunner:
    return ModelRunner(str(model_dir), num_blocks=96, block_size=4, dtype=dtype, cpu_kernels=kernels)


def _arrivals(model_dir, **sampling) -> dict[int, list]:
    prompts = prompts_for(model_dir)  # 58 and 47 tokens: several windows long, in chunks of 24 beside decodes
    return {
        0: [request("a", prompts[0], MAX_NEW, **sampling), request("b", prompts[2], MAX_NEW, **sampling)],
        2: [request("c", prompts[4], MAX_NEW, **sampling), request("d", prompts[3], MAX_NEW, **sampling)],
    }


def _engine(runner: ModelRunner, model_dir) -> Engine:
    return Engine.build(runner, model_dir, max_batch_prefill_tokens=40, max_prefill_tokens_while_decoding=24)


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_are_as_close_to_float32_as_the_torch_ops(tiny_dirs, arch):
    """Teacher-forced: every step of a bf16 engine runs the walk with the kernels, the same walk with torch's ops
    (its logits and K/V go on) and a float32 runner on the same tokens and slots (its own pages); against float32,
    the kernels' logits are off by no more than the torch ops' are."""
    model_dir = tiny_dirs[arch]
    assert max(len(r.input_ids) for reqs in _arrivals(model_dir).values() for r in reqs) > 5 * SLIDING_WINDOW
    fast, exact = _runner(model_dir, True), _runner(model_dir, False, torch.float32)
    assert fast.cpu_kernels and fast.attention == "cpu" and fast.walk.kernels
    torch_ops = DecoderWalk(fast.walk.model, "", fast.walk.kind, kernels=False)  # the same modules and pages
    errors, mixed = [], []

    def three(batch):
        p = batch.paged
        n_q = p.host_cu[1:] - p.host_cu[:-1]
        if (n_q == 1).any() and (n_q > cpu.SHORT_QUERIES).any():
            mixed.append(len(n_q))
        ids, pos, keep = batch.input_ids, batch.position_ids, batch.keep
        exact_paged = PagedBatch.from_host(
            exact.kv_cache, p.slot_mapping.numpy(), p.host_cu, p.host_context, p.host_tables, p.block_size,
            exact.device, kv_flat=exact.kv_flat,
        )  # fmt: skip
        truth = exact.walk.forward(ids, pos, keep, exact_paged).float()
        before = cpu.layers_attended
        got = fast.walk.forward(ids, pos, keep, p).float()
        short = (n_q <= cpu.SHORT_QUERIES).any()
        assert cpu.layers_attended - before == short * len(fast.walk.layers)  # the kernel ran where it had rows
        p.backend, p._groups = "torch", {}
        want = torch_ops.forward(ids, pos, keep, p)
        errors.append(((got - truth).abs().max().item(), (want.float() - truth).abs().max().item()))
        return want

    fast._forward = three
    steps = Steps(engine := _engine(fast, model_dir))
    engine.run(_arrivals(model_dir))
    assert len(errors) > MAX_NEW and mixed  # decodes beside a prefill chunk: the kernel and the groups in one step
    assert len(steps.chunks("b")) > 1
    kernels, ops = (torch.tensor(e) for e in zip(*errors))
    assert kernels.mean() <= 1.15 * ops.mean() and kernels.max() <= 1.5 * ops.max(), (kernels, ops)

    del fast._forward  # free-running: the kernels serve every step that has a short row
    steps_before = fast.walk.kernel_steps
    out = _engine(fast, model_dir).run(_arrivals(model_dir))
    assert all(len(o.tokens) == MAX_NEW or o.finish for o in out.values())
    assert fast.walk.kernel_steps > steps_before


def test_verified_drafts_give_the_decodes_tokens(tiny_dirs):
    """In bf16 a token's attention by the kernel is the same in a row of drafts as in a decode, so speculation
    changes no greedy token."""
    from tests.services.shard.test_verify import drafted_run

    model_dir = tiny_dirs["llama"]
    prompts = prompts_for(model_dir)[1:4]
    greedy = [SamplingParams() for _ in prompts]
    answers, _, _, _ = drafted_run(_runner(model_dir, True), prompts, 24, greedy)
    before = cpu.layers_attended
    drafted, _, _, (n_drafts, accepted) = drafted_run(_runner(model_dir, True), prompts, 24, greedy, answers)
    assert drafted == answers and 0 < accepted < n_drafts
    assert cpu.layers_attended > before


def test_float32_and_the_switch_keep_the_torch_ops(tiny_dirs):
    exact = _runner(tiny_dirs["llama"], True, torch.float32)
    assert not exact.cpu_kernels and exact.attention == "torch" and not exact.walk.kernels
    before = cpu.layers_attended
    prompt = prompts_for(tiny_dirs["llama"])[1]
    Engine.build(exact, tiny_dirs["llama"]).run({0: [request("p", prompt, 4)]})
    assert cpu.layers_attended == before
    with pytest.raises(ValueError, match="attention cpu needs the CPU kernels"):
        ModelRunner(str(tiny_dirs["llama"]), num_blocks=8, dtype=torch.float32, attention="cpu")
