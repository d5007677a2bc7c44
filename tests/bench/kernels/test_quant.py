"""The quantized-linear benchmark (bench/kernels/quant.py) runs every way on small shapes and the tiny model: the
layer kernels, torch's int8 kernels, the shard's decode steps through the in-process engine, transformers' decode
steps (timings are reported, not tested)."""

from __future__ import annotations

import torch

from bench.kernels import quant as bench
from services.shard.model import onednn


def test_the_benchmark_runs_every_way(capsys):
    rows = bench.measure([(256, 128)], [1, 5], rounds=1)
    assert [r["rows"] for r in rows] == [1, 5]
    assert {"fp32", "w8a8", "int4", "int4 bf16", "int8", "int8 bf16"} <= set(rows[0])
    assert "resident weight bytes, share of fp32: fp32 100%" in capsys.readouterr().out


def test_the_int8_kernel_benchmark_runs_every_kernel(capsys):
    rows = bench.measure_w8a8([(128, 64)], [1, 3], reps=2)
    assert [r["rows"] for r in rows] == [1, 3]
    baseline = "bf16 oneDNN" if onednn.dtype_supported(torch.bfloat16) else "bf16 torch"
    kernels = {baseline, "W8A8 served", "_int_mm alone", "qlinear_pointwise", "linear_dynamic"}
    assert kernels <= set(rows[0]) and all(rows[1][k] > 0 for k in kernels)
    assert "W8A8 served" in capsys.readouterr().out


def test_the_step_benchmark_compares_fp32_bf16_and_w8a8(tiny_dirs, capsys):
    got = bench.measure_steps(str(tiny_dirs["llama"]), [2], steps=3, prompt=4)
    assert set(got[2]) == {"fp32", "bf16", "w8a8"} and all(v > 0 for v in got[2].values())
    assert "tok/s vs fp32: bf16" in capsys.readouterr().out


def test_the_model_benchmark_runs_every_way(tiny_dirs):
    rows = {r["way"]: r for r in bench.measure_model(str(tiny_dirs["llama"]), [2], steps=1, prompt=4)}
    assert set(rows) == {"fp32", "bf16", "w8a8", "int4", "w8a8 bf16", "int4 bf16"}
    assert all(r["tok/s@2"] > 0 for r in rows.values())
    assert rows["int4"]["weights MB"] < rows["w8a8"]["weights MB"] < rows["fp32"]["weights MB"]
