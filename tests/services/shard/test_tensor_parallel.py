"""Tensor parallel ModelRunner: 2 ranks (spawned processes, gloo), each driven by its own in-process engine
(bench/engine.py) through the same continuous-batching schedule as test_model_runner's: the same plans on every
rank, as the scheduler sends them. Rank 0's greedy tokens must equal transformers' generate() and the
single-process runner's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bench.engine import Engine, request
from tests.ports import free_port
from tests.reference import reference_generate
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import ARCHS, prompts_for

WORLD = 2
BLOCK_SIZE = 8
NUM_BLOCKS = 22  # fewer than the requests take in all, enough for those running at once


def _arrivals(prompts: list[list[int]]) -> dict[int, list]:
    return {
        0: [request("0", prompts[0], 10), request("1", prompts[1], 12)],
        2: [request("2", prompts[2], 12)],  # chunks of 16 beside the running decodes
        8: [request("4", prompts[4], 8)],  # after others finished, on blocks they held
    }


def _serve(runner, model_dir) -> dict[str, list[int]]:
    engine = Engine.build(runner, model_dir, max_prefill_tokens_while_decoding=16)
    steps = Steps(engine)
    got = engine.run(_arrivals(prompts_for(Path(model_dir))))
    assert len(steps.chunks("2")) > 1 and steps.beside_decodes("2") and "4" in steps.reused
    return {rid: out.tokens for rid, out in got.items()}


def _rank(rank: int, model_dirs: dict[str, str], port: int, out: str) -> None:
    """One rank serving every architecture in turn, in one process group (a spawn costs seconds of imports)."""
    import torch.distributed as dist

    from services.shard import tensor_parallel
    from services.shard.model_runner import ModelRunner

    torch.set_num_threads(1)
    tensor_parallel.STALE_S = 0.0  # no restart to wait out here
    tensor_parallel.init_group(rank, WORLD, port, torch.device("cpu"), timeout_s=60)
    try:
        for arch, model_dir in model_dirs.items():
            # no grammar side: its loader thread, still building when a fast rank exits, can abort the process
            runner = ModelRunner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, grammar=False)
            assert runner.num_kv_heads == runner.model.config.num_key_value_heads // WORLD
            Path(f"{out}.{arch}.{rank}").write_text(json.dumps(_serve(runner, model_dir)))
        # both ranks out of their last collective before either tears its connections down: a rank whose peer
        # closed while gloo's background thread still read the pair can abort ('terminate called …')
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_dirs, tmp_path_factory) -> dict[str, list[dict]]:
    """arch → each rank's tokens by request id, from one spawn of two ranks that serve every architecture."""
    out = str(tmp_path_factory.mktemp("tp") / "tokens")
    dirs = {arch: str(tiny_dirs[arch]) for arch in ARCHS}
    mp.spawn(_rank, args=(dirs, free_port(), out), nprocs=WORLD, join=True)
    return {arch: [json.loads(Path(f"{out}.{arch}.{r}").read_text()) for r in range(WORLD)] for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_match_generate_and_one_rank(tiny_dirs, two_ranks, arch):
    model_dir = tiny_dirs[arch]
    ranks = two_ranks[arch]
    assert ranks[0] == ranks[1]  # every rank samples the same tokens from the same (whole) logits

    from services.shard.model_runner import ModelRunner

    single = _serve(ModelRunner(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE), model_dir)
    for req in (r for reqs in _arrivals(prompts_for(model_dir)).values() for r in reqs):
        want = reference_generate(model_dir, req.input_ids.tolist(), req.max_new_tokens)
        assert ranks[0][req.request_id] == want, f"{arch} request {req.request_id}: 2 ranks vs generate()"
        assert single[req.request_id] == want, f"{arch} request {req.request_id}: 1 rank vs generate()"
