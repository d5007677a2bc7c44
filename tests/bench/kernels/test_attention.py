"""The prefill attention benchmark (bench/kernels/attention.py): every candidate computes the same attention as the
shard's eager tiles, on full and sliding-window layers (timings are reported, not tested)."""

import pytest
import torch

from bench.kernels import attention


@pytest.mark.parametrize("shape", list(attention.SHAPES))
@pytest.mark.parametrize("window", [0, 100])
def test_every_candidate_computes_the_same_attention(shape, window):
    heads, _, d, *_ = attention.SHAPES[shape]
    n = 300
    ways, _ = attention.candidates(n, attention.SHAPES[shape], torch.float32, window, flex=False, sweep=True)
    assert {"eager-whole", "eager-tiles", "sdpa-tiles", "sdpa-tiles-128", "sdpa-row"} <= set(ways)
    want = ways["eager-tiles"]()  # [n, heads, d]
    for name, fn in ways.items():
        got = fn()
        if name == "eager-whole":  # [kv heads, heads per kv head × n, d]
            got = got.reshape(heads, n, d).transpose(0, 1)
        elif name == "sdpa-row":  # [1, heads, n, d]
            got = got[0].transpose(0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def test_the_table_rows(capsys):
    rows = attention.measure([64], {"llama-64": attention.SHAPES["llama-64"]}, ["float32"], 1, False)
    assert [(r["shape"], r["layer"], r["n"]) for r in rows] == [("llama-64", "full", 64)]
    assert all(ms > 0 for ms in rows[0]["ms"].values())


def test_only_the_chosen_candidates_are_timed(capsys):
    """`--ways`: the named candidates alone, their times printed without a ratio (no baseline among them)."""
    rows = attention.measure([64], {"llama-64": attention.SHAPES["llama-64"]}, ["float32"], 1, False, only={"sdpa-row"})
    assert set(rows[0]["ms"]) == {"sdpa-row"}
    attention._line(rows[0])
    line = capsys.readouterr().out
    assert "—" in line and "x)" not in line


def test_a_models_shape_and_prefill(tiny_dirs):
    folder = str(tiny_dirs["gemma3"])
    heads, kv_heads, d, window, scaling, softcap = attention.model_shape(folder)
    assert heads % kv_heads == 0 and d > 0 and scaling > 0
    assert attention.prefill(folder, 40, "float32", 1) > 0
    times, _ = attention.chunked(folder, 40, 16, "float32")
    assert len(times) == 3  # 16 + 16 + 8 tokens
