"""The quantize workload's own pieces (bench/workloads/quantize.py), without servers: finding the shard in a process
tree and reading its memory, the quality proxy, and the table (the whole workload runs end to end with
`switchyard bench --workload quantize`)."""

from __future__ import annotations

import subprocess
import sys

from bench.workloads import quantize as qs


def test_the_shard_is_found_under_its_launcher_and_its_memory_read():
    # a parent that starts a child whose argv names services.shard, as supervisord under the launcher does
    child = "import sys; sys.stdin.read()"
    parent = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}, 'services.shard'], "
              "stdin=sys.stdin); print(p.pid, flush=True); p.wait()")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(proc.stdout.readline())
        assert qs.shard_pids(proc.pid) == [child_pid]
        mem = qs.memory_mib(child_pid)
        assert 0 < mem["VmRSS"] <= mem["VmHWM"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_the_quality_proxy_counts_agreement_before_the_first_difference():
    ref = [{"ids": [1, 2, 3, 4], "prefill": [-1.0, -2.0]}, {"ids": [5, 6], "prefill": [-0.5]}]
    got = [{"ids": [1, 2, 9, 4], "prefill": [-1.5, -2.0]}, {"ids": [5, 6], "prefill": [-0.25]}]
    q = qs.quality(got, ref)
    assert q["greedy_agreement"] == (2 / 4 + 2 / 2) / 2 and q["greedy_exact"] == 1 and q["greedy_prompts"] == 2
    assert q["logprob_delta_max"] == 0.5 and q["logprob_delta_mean"] == (0.5 + 0 + 0.25) / 3
    assert qs.quality(ref, ref)["greedy_agreement"] == 1.0


def test_the_table_names_the_cpu_and_every_level():
    level = {"output_tok_s": 10.0, "itl_p50_ms": 5.0}
    rows = [{"method": m, "dtype": "bfloat16", "levels": [{**level, "concurrency": c} for c in (1, 16)],
             "long_prompt_ttft_ms": 100.0, "load_peak_mib": 900.0, "serving_rss_mib": rss, "kv_mib": 100.0,
             "rss_less_kv_mib": rss - 100,
             "quality": qs.quality([], [])} for m, rss in (("none", 800.0), ("eetq", 400.0))]  # fmt: skip
    results = {"title": "t", "cpu": "CPU [avx2]", "long_prompt": 512, "rows": rows, "failed": {"x": "why"},
               "runtime_mib": 200.0}  # fmt: skip
    text = qs.table(results)
    assert "CPU: CPU [avx2]" in text and "tok/s c=16" in text and "TTFT 512-tok ms" in text
    # RSS − KV 300 of 700 (43 %); less the 200 MiB runtime the model takes 100 of 500 (20 %)
    assert "| eetq | bfloat16 | 10.0 | 10.0 | 5.0 | 5.0 | 100 | 900 | 400 | 100 | 300 | 43% | 100 | 20% |" in text
    assert "x: why" in text


def test_the_runtime_baseline_is_a_shards_imports_without_a_model():
    assert 100 < qs.runtime_mib() < 2000  # torch and transformers alone take a few hundred MiB


def test_the_kv_cache_is_sized_from_the_config(tmp_path):
    import json

    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # SmolLM2's shape: 30 layers × K and V × 3 heads × 64 × 4 bytes = 90 KiB a token in float32
    assert qs.kv_mib(tmp_path, 4096, "float32") == 4096 * 30 * 2 * 3 * 64 * 4 / 2**20
    assert qs.kv_mib(tmp_path, 4090, "bfloat16") == qs.kv_mib(tmp_path, 4096, "float32") / 2  # whole blocks
