"""The serving dtype chosen from the processor's flags and the checkpoint's dtype."""

from __future__ import annotations

import json

import pytest

from libs.runtime import cpu

AVX2 = frozenset({"avx", "avx2", "fma"})
ZEN4 = AVX2 | {"avx512f", "avx512_bf16", "avx512_vnni"}
SAPPHIRE = AVX2 | {"avx512f", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(("flags", "want"), [(AVX2, "float32"), (ZEN4, "bfloat16"), (SAPPHIRE, "bfloat16")])
def test_cpu_default_is_bf16_only_where_native(flags, want):
    got = cpu.choose_dtype(None, "float32", "cpu", cpu_flags=flags)
    assert got.dtype == want
    assert ("natively" in got.reason) == (want == "bfloat16")
    assert cpu.choose_dtype("auto", "bfloat16", "cpu", cpu_flags=flags).dtype == want


def test_an_explicit_dtype_wins():
    for name in cpu.DTYPES:
        assert cpu.choose_dtype(name, "bfloat16", "cpu", cpu_flags=ZEN4).dtype == name
    with pytest.raises(ValueError, match="--dtype must be one of"):
        cpu.choose_dtype("float64")


def test_cuda_keeps_a_half_checkpoint_and_halves_a_float32_one():
    assert cpu.choose_dtype(None, "float16", "cuda:0").dtype == "float16"
    assert cpu.choose_dtype(None, "float32", "cuda:0").dtype == "bfloat16"
    assert cpu.choose_dtype(None, "bfloat16", "cuda:0", cuda_bf16=False).dtype == "float16"


def test_checkpoint_dtype_reads_both_config_spellings(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert cpu.checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert cpu.checkpoint_dtype(tmp_path) == "float32"
    assert cpu.checkpoint_dtype(tmp_path / "missing") is None


def test_this_machine_is_described():
    line = cpu.describe()
    assert line and "[" in line


def test_torch_cpu_build_agrees_with_torch():
    """The launcher's no-import answer equals what torch says of its own build."""
    import torch

    assert cpu.torch_cpu_build() == (torch.version.cuda is None and torch.version.hip is None)
