"""The token-choice benchmark (bench/kernels/sampling.py): the shard's `choose` against plain torch on every batch
kind, its greedy rows checked against torch's argmax (timings are reported, not tested)."""

import pytest
import torch

from bench.kernels import sampling


@pytest.mark.parametrize("kind", sampling.KINDS)
def test_choose_against_torch(kind):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)) * 2
    ways = {"torch": sampling.plain_torch, "stages": sampling.sampler.choose}
    got = sampling.measure_case(ways, logits, sampling.batch_params(kind, 8), reps=2)
    assert got["torch"] > 0 and got["stages"] > 0 and got["logprob_drift"] < 1e-4


def test_an_unknown_kind_fails_before_timing():
    with pytest.raises(ValueError, match="unknown batch kind"):
        sampling.batch_params("beam", 1)
