"""The decode-graph buckets and padding (services/shard/graphs.py), on CPU: TGI's `--cuda-graphs` semantics, the
bucket a step runs in, fixed shapes, and that padded rows write and read the scratch block only (a simulated KV
write, then a real decode step of the tiny model run padded: same logits, real KV slots as unpadded). The capture
and replay themselves need CUDA (scripts/gpu_check.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine import Engine, request
from services.shard.attention.paged import PagedBatch
from services.shard.graphs import (
    DecodeBuffers,
    DecodeGraphs,
    DecodeStep,
    bucket_for,
    build,
    decode_step,
    pad_step,
    pure_decode,
)
from services.shard.model_runner import ModelRunner
from tests.tiny_models import prompts_for

BS, BLOCKS = 4, 10  # block size; the scheduler's blocks (the scratch block is block 10)


def test_bucket_for():
    buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 200, 256)] == [1, 2, 4, 8, 8, 16, 256, 256]
    assert bucket_for(257, buckets) is None and bucket_for(1, ()) is None
    assert pure_decode(np.ones(3, np.int64)) and not pure_decode(np.array([1, 2]))
    assert not pure_decode(np.ones(2, np.int64), np.array([0, 1])) and not pure_decode(np.zeros(0, np.int64))


def _step(rows: int, seed: int = 0) -> DecodeStep:
    """A decode step of `rows` rows on disjoint real blocks (0 … BLOCKS-1), as the runner lays one out."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(BLOCKS)
    per = min(BLOCKS // rows, 4)
    tables = np.full((rows, per), -1, np.int64)
    context = np.zeros(rows, np.int64)
    for r in range(rows):
        used = int(rng.integers(1, per + 1))
        tables[r, :used] = blocks[r * per : r * per + used]
        context[r] = int(rng.integers((used - 1) * BS, used * BS))  # the new token lands in the last block
    rows_at = np.arange(rows)
    slots = tables[rows_at, context // BS] * BS + context % BS
    return DecodeStep(rng.integers(1, 100, rows), context.copy(), slots, tables, context)


@pytest.mark.parametrize("rows,bucket", [(1, 1), (3, 4), (5, 8), (2, 2)])
def test_padding_shapes_and_real_rows_unchanged(rows, bucket):
    step = _step(rows, seed=rows)
    padded = pad_step(step, bucket, max_blocks=6, scratch_block=BLOCKS, block_size=BS)
    assert padded.rows == bucket and padded.block_tables.shape == (bucket, 6)
    for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
        assert getattr(padded, name).shape == (bucket,)
        assert np.array_equal(getattr(padded, name)[:rows], getattr(step, name))
    assert np.array_equal(padded.block_tables[:rows, : step.block_tables.shape[1]], step.block_tables)
    assert (padded.block_tables[:rows, step.block_tables.shape[1] :] == -1).all()
    # padded rows: token 0 at position 0, no context, the scratch block alone
    assert (padded.input_ids[rows:] == 0).all() and (padded.positions[rows:] == 0).all()
    assert (padded.context_lens[rows:] == 0).all()
    assert (padded.block_tables[rows:, 0] == BLOCKS).all() and (padded.block_tables[rows:, 1:] == -1).all()
    assert (padded.slot_mapping[rows:] == BLOCKS * BS).all()
    with pytest.raises(ValueError):  # tables wider than the buffers
        pad_step(step, bucket, step.block_tables.shape[1] - 1, BLOCKS, BS)
    with pytest.raises(ValueError):  # more rows than the bucket
        pad_step(step, rows - 1, 6, BLOCKS, BS)


def test_padded_rows_cannot_touch_real_kv():
    """A KV write at the padded slot mapping (as paged.write_kv's index_copy_) changes no slot of the scheduler's
    blocks but the real rows' own; the blocks every padded row can read are the scratch block only."""
    step = _step(3, seed=7)
    padded = pad_step(step, 8, max_blocks=4, scratch_block=BLOCKS, block_size=BS)
    kv = torch.zeros(2, (BLOCKS + 1) * BS, 5)  # [kv_heads, slots, D], one block more than the scheduler's
    new = torch.ones(2, 8, 5)
    kv.index_copy_(1, torch.from_numpy(padded.slot_mapping), new)
    written = set(np.flatnonzero(kv[0, :, 0].numpy()).tolist())
    real = set(step.slot_mapping.tolist())
    assert written == real | {BLOCKS * BS}
    assert all(s < BLOCKS * BS for s in real)
    # what a padded row may read: its context (none) plus its one new key, in its table's blocks
    for r in range(3, 8):
        visible = padded.block_tables[r][padded.block_tables[r] >= 0]
        assert visible.tolist() == [BLOCKS]
        last = padded.context_lens[r]  # the new token's position: 0
        assert padded.block_tables[r, last // BS] * BS + last % BS == padded.slot_mapping[r]


def test_buffers_load_in_place():
    buffers = DecodeBuffers(8, 4, torch.device("cpu"), scratch_block=BLOCKS, block_size=BS)
    addresses = {k: v.data_ptr() for k, v in buffers.view(8).items()}
    for rows, bucket in ((3, 4), (5, 8), (1, 1)):
        step = _step(rows, seed=rows)
        padded = pad_step(step, bucket, 4, BLOCKS, BS)
        buffers.load(padded)
        view = buffers.view(bucket)
        assert {k: v.data_ptr() for k, v in buffers.view(8).items()} == addresses  # same storage every step
        assert view["input_ids"].tolist() == padded.input_ids.tolist()
        assert view["slot_mapping"].tolist() == padded.slot_mapping.tolist()
        assert view["block_tables"].tolist() == padded.block_tables.tolist()
        assert view["block_tables"].dtype == torch.int32 and view["context_lens"].dtype == torch.int32
        assert view["cu_seqlens_q"].tolist() == list(range(bucket + 1))


def test_graphs_refuse_a_cpu_device():
    with pytest.raises(RuntimeError):
        DecodeGraphs((1, 2), 4, BLOCKS, BS, torch.device("cpu"))
    cpu = torch.device("cpu")
    assert build((1, 2), None, [], None, BLOCKS, BS, cpu, "torch") == (None, "CUDA graphs need CUDA")
    assert build((), None, [], None, BLOCKS, BS, cpu, "triton")[0] is None


def test_fresh_buffers_are_padding():
    """Before any step is loaded (a capture's warm-up) every row writes the scratch block only."""
    buffers = DecodeBuffers(8, 4, torch.device("cpu"), scratch_block=BLOCKS, block_size=BS)
    assert (buffers.slot_mapping == BLOCKS * BS).all() and (buffers.block_tables[:, 0] == BLOCKS).all()
    assert (buffers.block_tables[:, 1:] == -1).all() and (buffers.context_lens == 0).all()


def test_a_padded_decode_step_on_the_model(tiny_dirs):
    """A real decode step of 3 rows from the runner, padded to a bucket of 4 and run eagerly on CPU (the torch
    attention over the padded metadata, as a graph would replay it): the real rows' logits are the unpadded step's,
    and the KV cache differs from the unpadded run's in the scratch block only."""
    model_dir = tiny_dirs["llama"]
    runner = ModelRunner(str(model_dir), num_blocks=32, block_size=4)
    assert runner.walk is not None
    scratch = 31  # the requests below take far fewer blocks: block 31 stays the scheduler's last, unused
    eager_forward, checked = runner._forward, []

    def forward(batch):
        step = decode_step(batch)
        if step is None or step.rows != 3 or checked:
            return eager_forward(batch)
        assert (step.block_tables < scratch).all()
        assert np.array_equal(step.slot_mapping, batch.paged.slot_mapping.numpy())
        assert np.array_equal(step.positions, batch.position_ids.numpy())
        before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
        padded = pad_step(step, 4, max_blocks=8, scratch_block=scratch, block_size=4)
        paged = PagedBatch(
            kv_cache=runner.kv_cache,
            kv_flat=runner.kv_flat,
            slot_mapping=torch.from_numpy(padded.slot_mapping),
            cu_seqlens_q=torch.arange(5, dtype=torch.int32),
            context_lens=torch.from_numpy(padded.context_lens.astype(np.int32)),
            block_tables=torch.from_numpy(padded.block_tables.astype(np.int32)),
            block_size=4,
            host_cu=np.arange(5),
            host_context=padded.context_lens,
            host_tables=padded.block_tables,
        )
        ids, pos = torch.from_numpy(padded.input_ids), torch.from_numpy(padded.positions)
        got = runner.walk.forward(ids, pos, torch.arange(4), paged)  # the runner's eager forward (forward_packed)
        after_padded = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
        for (k0, v0), (k1, v1) in zip(before, runner.kv_cache):  # eager from the same cache
            k1.copy_(k0), v1.copy_(v0)
        want = eager_forward(batch)
        torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
        for (kp, vp), (ke, ve), (k0, _) in zip(after_padded, runner.kv_cache, before):
            torch.testing.assert_close(kp[:, :scratch], ke[:, :scratch], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(vp[:, :scratch], ve[:, :scratch], rtol=1e-6, atol=1e-6)
            assert not torch.equal(kp[:, scratch], k0[:, scratch])  # the padded row wrote its K there
        checked.append(True)
        return want

    runner._forward = forward
    prompts = prompts_for(model_dir)
    arrivals = {0: [request(str(i), prompts[i][:9], 3) for i in range(3)]}
    got = Engine.build(runner, model_dir).run(arrivals)
    assert checked and all(len(out.tokens) == 3 for out in got.values())


def test_runner_graphs_stay_off_on_cpu(tiny_dirs):
    """ModelRunner(cuda_graphs=...) on CPU: no graphs, no scratch block, the eager forward as ever."""
    runner = ModelRunner(str(tiny_dirs["llama"]), num_blocks=8, block_size=4, cuda_graphs=(1, 2, 4))
    assert runner.graphs is None and runner.graphs_reason == "CUDA graphs need CUDA"
    assert runner.kv_cache[0][0].shape[1] == 8
