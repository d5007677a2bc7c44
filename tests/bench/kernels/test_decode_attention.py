"""The decode-attention benchmark (bench/kernels/decode_attention.py): both backends run on the same step and agree
before anything is timed (timings are reported, not tested)."""

import pytest

from bench.kernels import decode_attention
from bench.kernels.attention import SHAPES
from services.shard import cpu_kernels


@pytest.mark.parametrize("shape", list(SHAPES))
def test_backends_agree_and_are_timed(shape):
    assert cpu_kernels.load(), cpu_kernels.reason()
    got = decode_attention.measure(3, 40, SHAPES[shape], rounds=1, calls=1)
    assert got["torch_us"] > 0 and got["cpu_us"] > 0 and got["drift"] < 0.05


def test_the_script_prints_its_table(capsys):
    assert decode_attention.main(["--rows", "2", "--context", "20", "--shape", "llama-64", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| llama-64 | 2 | 20 |" in out and "×" in out
