"""The structured workload (bench/workloads/structured.py): its pairing (the unconstrained twins get prompts of their
own, the same lengths, so the prefix cache cannot skip their prefills, and ask for exactly as many tokens as the
constrained answers took), the server-side readings, and the whole workload end to end on the tiny model."""

import json

import pytest

from bench.serving import loadgen
from bench.serving.workload import Prompts
from bench.workloads.structured import grammar_side, grammar_totals, model_folder, paired, server_side
from libs.runtime.settings import BLOCK_SIZE


def test_twins_have_fresh_prompts_of_the_same_length():
    _, folder = model_folder("tiny")
    prompts = Prompts(folder)
    jobs = prompts.fixed(6, 3 * BLOCK_SIZE + 1, 40)
    answers = [loadgen.Sample(sent=0.0, tokens=n) for n in (12, 40, 1, 0, 25, 7)]
    twins = paired(jobs, answers, Prompts(folder, seed=1))
    assert [t.max_new_tokens for t in twins] == [12, 40, 1, 1, 25, 7]  # an empty answer still asks for one
    assert [t.prompt_tokens for t in twins] == [j.prompt_tokens for j in jobs]
    first_block = {tuple(prompts.tok.encode(j.prompt).ids[:BLOCK_SIZE]) for j in jobs}
    for twin in twins:  # not even the first block of a constrained prompt: no prefix-cache hit at all
        ids = prompts.tok.encode(twin.prompt).ids
        assert len(ids) == twin.prompt_tokens and tuple(ids[:BLOCK_SIZE]) not in first_block


def test_server_side_counts_one_run():
    before = {"tgi_batch_inference_count": 10, "tgi_batch_forward_duration_sum": 1.0}
    after = {
        "tgi_batch_inference_count": 30,
        "tgi_batch_forward_duration_sum": 2.0,
        "tgi_batch_forward_duration_count": 20,
        "switchyard_prefix_cache_hit_tokens_total": 48,
        "switchyard_constrained_rows_sum": 80,
    }
    got = server_side(before, after, output_tokens=80)
    assert got == {"steps": 20, "tokens_per_step": 4.0, "forward_ms": 50.0, "prefix_hit_tokens": 48,
                   "constrained_rows": 80}  # fmt: skip


def test_the_shard_grammar_totals_are_read_from_the_server_log(tmp_path):
    log = tmp_path / "server.log"
    assert grammar_totals(log) == {}  # no log yet
    first = "grammar totals: steps=10 rows=40 compiled=1 reused=3 ahead_rows=36 inline_rows=4 open_s=0.0010 "
    first += "apply_s=0.0100 advance_s=0.0040 fill_ahead_s=0.0300"
    last = "grammar totals: steps=30 rows=120 compiled=1 reused=7 ahead_rows=112 inline_rows=8 open_s=0.0030 "
    last += "apply_s=0.0300 advance_s=0.0120 fill_ahead_s=0.0900"
    log.write_text(f"2026-12-01T18:00:00 INFO shard.0 switchyard.shard.grammar: {first}\nother line\n")
    before = grammar_totals(log)
    with log.open("a") as f:
        f.write(f'{{"message": "{last}", "level": "INFO"}}\n')  # a JSON log line reads the same
    got = grammar_side(before, grammar_totals(log))
    assert got["steps"] == 20 and got["rows_per_step"] == 4.0
    assert abs(got["path_ms_per_step"] - 1000 * (0.002 + 0.02 + 0.008) / 20) < 1e-9
    assert abs(got["fill_ahead_ms_per_step"] - 3.0) < 1e-9
    assert (got["compiled"], got["reused"], got["ahead_rows"], got["inline_rows"]) == (0, 4, 76, 4)


@pytest.mark.e2e
def test_structured_bench_smoke(tmp_path):
    """`switchyard bench --workload structured` end to end on the tiny model with small counts: every constrained
    answer validated, the unconstrained twins asked for the same lengths, the masks seen in the server's metric, the
    in-process step measured, a 12-function tool schema's compile timed, and the report files written. One level of
    2 streams per grammar: a level is the same code at any count (and each level pays seconds for its metrics to
    settle), while 2 streams still share steps."""
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
