"""Tensor parallel ModelRunner: 2 ranks (spawned processes, gloo) drive the same continuous-batching schedule as
test_model_runner; rank 0's greedy tokens must equal transformers' generate() and the single-process runner's."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.reference import reference_generate
from tests.shard.driver import Request, drive
from tests.tiny_models import ARCHS, prompts_for

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _schedule(prompts: list[list[int]]) -> list[Request]:
    return [
        Request(prompts[0], 10, join=1),
        Request(prompts[1], 12, join=1),
        Request(prompts[2], 12, join=3, chunk=16),  # chunked prefill joins running decodes
        Request(prompts[4], 8, join=9),  # joins after others finished, on their freed blocks
    ]


def _rank(rank: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from services.shard import tensor_parallel
    from services.shard.model_runner import ModelRunner

    torch.set_num_threads(1)
    tensor_parallel.STALE_S = 0.0  # no restart to wait out here
    tensor_parallel.init_group(rank, WORLD, port, torch.device("cpu"), timeout_s=60)
    try:
        runner = ModelRunner(model_dir, num_blocks=64, block_size=8)
        assert runner.num_kv_heads == runner.model.config.num_key_value_heads // WORLD
        got = drive(runner, _schedule(prompts_for(__import__("pathlib").Path(model_dir))))
        with open(f"{out}.{rank}", "w") as f:
            json.dump({str(k): v for k, v in got.items()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_match_generate_and_one_rank(tiny_dirs, arch, tmp_path):
    model_dir = tiny_dirs[arch]
    out = str(tmp_path / "tokens")
    mp.spawn(_rank, args=(str(model_dir), _free_port(), out), nprocs=WORLD, join=True)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(WORLD)]
    assert ranks[0] == ranks[1]  # every rank samples the same tokens from the same (whole) logits
    requests = _schedule(prompts_for(model_dir))

    from services.shard.model_runner import ModelRunner

    single = drive(ModelRunner(str(model_dir), num_blocks=64, block_size=8), requests)
    for seq, req in enumerate(requests):
        want = reference_generate(model_dir, req.prompt, req.max_new)
        assert ranks[0][str(seq)] == want, f"{arch} seq {seq}: 2 ranks vs generate()"
        assert single[seq] == want, f"{arch} seq {seq}: 1 rank vs generate()"
