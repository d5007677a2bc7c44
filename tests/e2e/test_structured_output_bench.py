"""`switchyard bench --workload structured` end to end on the tiny model with small counts: every constrained
answer validated, the unconstrained twins asked for the same lengths, the masks seen in the server's metric, the
in-process step measured, a 12-function tool schema's compile timed, and the report files written. One level of
2 streams per grammar: a level is the same code at any count (and each level pays seconds for its metrics to
settle), while 2 streams still share steps."""

import json

import pytest


@pytest.mark.e2e
def test_structured_bench_smoke(tmp_path):
    from launcher.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--workload", "structured", "--model", "tiny", "--structured-streams", "2"]
    argv += ["--structured-waves", "1", "--structured-step-steps", "3", "--out", str(out)]
    assert main(argv) == 0  # non-zero when an answer is invalid or a level saw no masked row
    results = json.loads((out / "structured.json").read_text())
    levels = {(r["kind"], r["streams"]): r for r in results["levels"]}
    assert set(levels) == {("json", 2), ("regex", 2)}
    assert sum(r["valid"] for r in levels.values()) > 0  # answers the grammar ended were checked
    for r in levels.values():
        assert r["errors"] == 0 and r["valid"] + r["cut_by_length"] == r["requests"]
        assert r["constrained"]["output_tokens"] == r["unconstrained_tokens"]  # paired lengths
        assert r["constrained_rows"] >= r["constrained"]["output_tokens"] > 0
        # the shard's grammar totals cover the whole run, its last rows too: a mask per constrained row (no
        # drafts here), a matcher per request
        g = r["server"]["constrained"]["grammar"]
        assert g["ahead_rows"] + g["inline_rows"] == r["server"]["constrained"]["constrained_rows"], g
        assert g["compiled"] + g["reused"] == r["requests"], g
        # the regex's masks are remembered per DFA state (each request starts in the first): a JSON schema's are not
        assert (g["cached_rows"] >= r["requests"] - 1) if r["kind"] == "regex" else g["cached_rows"] == 0, g
    step = results["in_process"]
    assert step["batch"] == 2 and all(run["constrained"]["apply_ms_per_step"] > 0 for run in step["runs"])
    assert all(run["unconstrained"]["apply_ms_per_step"] == 0 for run in step["runs"])
    assert all(results["compile"][f"12 tools, tool_choice {c}"]["p50_ms"] > 0 for c in ("auto", "required"))
    md = (out / "structured.md").read_text()
    assert "| json | 2 |" in md and "| regex | 2 |" in md and results["cpu"] in md
