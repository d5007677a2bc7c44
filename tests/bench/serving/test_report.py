"""The report (bench/serving/report.py): the Markdown tables and the plot on synthetic results."""

from __future__ import annotations

import json

from bench.serving import report


def _synthetic() -> dict:
    limit = [{"batch": b, "tok_s": 10.0 * b, "decode_tok_s": 12.0 * b, "decode_step_ms": 50.0 + b, "prefill_s": 0.1}
             for b in (1, 4)]  # fmt: skip
    runs = []
    for engine, scale in (("switchyard", 0.9), ("vllm-cpu", 0.5)):
        for b in (1, 4):
            runs.append({"engine": engine, "workload": "fixed", "concurrency": b, "output_tok_s": 10.0 * b * scale,
                         "ttft_p50_ms": 100.0, "ttft_p90_ms": 120.0, "ttft_p99_ms": 130.0, "itl_p50_ms": 60.0 + b,
                         "itl_p90_ms": 70.0, "itl_p99_ms": 80.0, "errors": 0,
                         "series": [(0.0, 0.1, 1), (0.5, 0.3, b)]})  # fmt: skip
    return {"title": "synthetic", "limit": limit, "runs": runs, "skipped": {"transformers-cb": "not run"}}


def test_table_reports_fraction_of_limit_and_step_overhead():
    md = report.table(_synthetic())
    row = next(line for line in md.splitlines() if line.startswith("| switchyard | fixed | 4 |"))
    assert "| 36.0 | 90% |" in row
    assert "| 10.0 |" in row  # ITL p50 64 ms − in-process step 54 ms
    assert "| vllm-cpu | fixed | 1 | 5.0 | 50% |" in md
    assert "transformers-cb: not run" in md


def test_write_outputs_json_markdown_and_png(tmp_path):
    paths = report.write(_synthetic(), tmp_path / "out")
    assert json.loads(paths["json"].read_text())["title"] == "synthetic"
    assert paths["md"].read_text().startswith("| batch |")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
