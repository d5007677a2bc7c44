"""The roofline (bench/step/roofline.py): a decode step's bytes and products counted from the model's own modules
(checked against the config's shapes, counted apart), served ITLs read from a bench's results, and the whole table
on a tiny model (timings are reported, not tested)."""

import json

from bench.step import roofline
from tests.tiny_models import build_model


def _by_shape(cfg, batch: int, context: int) -> tuple[int, int]:
    """(bytes, flops) of one float32 decode step, from the config alone."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    kv_read = 2 * cfg.num_hidden_layers * kv * context * batch
    attn = 4 * cfg.num_hidden_layers * q * context * batch
    return 4 * (weights + kv_read), 2 * batch * weights + attn


def test_step_cost_counts_every_linear_the_head_and_the_kv_read(tmp_path):
    model = roofline.shapes(build_model(tmp_path / "llama", "llama"))  # the modules on the meta device
    cost = roofline.step_cost(model, batch=5, context=40, elem_bytes=4)
    assert (cost["bytes"], cost["flops"]) == _by_shape(model.config, 5, 40)
    assert cost["head_bytes"] == 4 * model.config.vocab_size * model.config.hidden_size
    # the bound is the slower of the two roofs
    mach = {"read_gbps": 10.0, "peak_gflops": 100.0}
    assert roofline.bound_ms(1e9, 1e9, mach) == 100.0  # 1 GB at 10 GB/s
    assert roofline.bound_ms(1e6, 1e12, mach) == 10_000.0  # 1 TFLOP at 100 GFLOP/s


def test_served_itl_reads_fixed_runs_of_the_model(tmp_path):
    runs = [
        {"engine": "switchyard", "workload": "fixed", "concurrency": 16, "itl_p50_ms": 41.8},
        {"engine": "vllm-cpu", "workload": "fixed", "concurrency": 16, "itl_p50_ms": 44.8},
        {"engine": "switchyard", "workload": "mixed", "concurrency": 16, "itl_p50_ms": 99.0},
    ]
    (tmp_path / "a.json").write_text(json.dumps({"model": "m", "runs": runs}))
    (tmp_path / "b.json").write_text(json.dumps({"model": "other", "runs": [{**runs[0], "itl_p50_ms": 1.0}]}))
    got = roofline.served_itl([str(tmp_path / "a.json"), str(tmp_path / "b.json")], "m")
    assert got == {("switchyard", 16): 41.8, ("vllm-cpu", 16): 44.8}


def test_the_table_on_a_tiny_model(tmp_path, capsys):
    folder = build_model(tmp_path / "llama", "llama")
    assert roofline.main(["--model", str(folder), "--batch", "1,3", "--output-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["dtype"] in ("float32", "bfloat16")  # the server's default on this CPU
    assert out["machine"]["read_gbps"] > 0 and out["machine"]["peak_gflops"] > 0
    assert [r["batch"] for r in out["rows"]] == [1, 3]
    for row in out["rows"]:
        assert row["bound_ms"] > 0 and row["ours_ms"] > 0 and row["ours_head_ms"] > 0
        assert row["served"] == {"switchyard": None, "vllm-cpu": None}
