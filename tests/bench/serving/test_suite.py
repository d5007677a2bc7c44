"""`switchyard bench` (bench/serving/suite.py): the CLI wiring, and one tiny end-to-end smoke through real processes."""

from __future__ import annotations

import json

import pytest

from launcher.cli import build_parser


def test_cli_has_bench():
    args = build_parser().parse_args(["bench", "--model", "tiny", "--concurrency", "1,2", "--peers", ""])
    assert args.command == "bench" and args.model == "tiny" and args.concurrency == "1,2"


@pytest.mark.e2e
def test_bench_smoke_end_to_end(tmp_path):
    """`switchyard bench` on the tiny model with tiny counts: the limit, a real server, the report files. One level
    (2 streams): each level costs a process that loads the model for the limit, and the levels share their code."""
    from launcher.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--model", "tiny", "--concurrency", "2", "--prompt-tokens", "12", "--output-tokens", "5"]
    assert main([*argv, "--mixed", "2", "--peers", "", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["batch"] for r in results["limit"]] == [2] and all(r["tok_s"] > 0 for r in results["limit"])
    fixed = {r["concurrency"]: r for r in results["runs"] if r["workload"] == "fixed"}
    assert set(fixed) == {2}
    for c, r in fixed.items():  # the no-EOS view makes every request run to exactly max_new_tokens
        assert r["errors"] == 0 and r["output_tokens"] == c * 5, r
        # tokens read in one burst (a loaded machine) have 0 ms gaps: the ITL is measured, not necessarily > 0
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] >= 0
        # the server's processes' CPU per 1,000 tokens, read from /proc: the shard did the forward
        cost = r["cpu_s_per_1k_tokens"]
        assert cost["shard"] > 0 and cost["all"] >= cost["shard"] + cost.get("http", 0), cost
    mixed = [r for r in results["runs"] if r["workload"] == "mixed"]
    assert len(mixed) == 1 and mixed[0]["errors"] == 0 and mixed[0]["requests"] == 4
    assert (out / "results.png").stat().st_size > 10_000
    assert "| switchyard | fixed | 2 |" in (out / "results.md").read_text()
    assert "CPU s per 1k tokens, by process" in (out / "results.md").read_text()
