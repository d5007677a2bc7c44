"""`switchyard bench --workload long-prompt` (bench/workloads/long_prompt.py, its in-process half in
bench/step/long_prompt.py) end to end on the tiny model with small counts: the in-process chunk sweep (the cap
fired: chunks no larger than it, every stream decoding beside them), the memory probe's chunks, a real server's TTFT
and ITL probes, and the report files."""

import json

import pytest


@pytest.mark.e2e
def test_long_prompt_bench_smoke(tmp_path):
    from launcher.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--workload", "long-prompt", "--model", "tiny", "--long-prompts", "300,600"]
    argv += ["--long-concurrency", "1,3", "--long-repeats", "2", "--long-streams", "4", "--long-stream-tokens", "1500"]
    argv += ["--long-memory-prompt", "300", "--long-memory-chunk", "128"]
    argv += ["--long-itl-prompt", "500", "--long-chunks", "0,128", "--long-engines", "switchyard", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    none, capped = results["sweep"]
    assert none["cap"] == 0 and none["steps"] == 1 and none["chunks"] == [500]
    assert capped["chunks"] == [128, 128, 128, 116] and capped["streams"] == 4
    mem = results["memory"]
    assert [(c["context"], c["tokens"]) for c in mem["chunks"]] == [(0, 128), (128, 128), (256, 44)]
    assert mem["token"] is not None and mem["loaded_rss_mib"] > 0
    (row,) = results["rows"]
    assert [(t["prompt_tokens"], t["concurrency"]) for t in row["ttft"]] == [(300, 1), (300, 3), (600, 1), (600, 3)]
    assert all(t["errors"] == 0 and t["ttft_p50_ms"] > 0 for t in row["ttft"])
    alone, during = row["itl"]
    assert alone["long_tokens"] == 0 and during["long_tokens"] == 500 and during["long_ttft_ms"] > 0
    assert alone["gaps"] > 0 and during["gaps"] > 0
    md = (out / "results.md").read_text()
    assert "| 600 tokens, c=3 |" in md and "| 128 |" in md and results["cpu"] in md
