"""`switchyard bench --workload vision` (bench/workloads/vision/) end to end on the tiny LLaVA-shaped model with
small counts: every level has its three rows, the image rows carried their images (the tokenizers counted one image
per request, the encoder ran, the prompt holds the image's tokens) and the text rows none; the flood check's image
requests were preprocessed while the streams decoded; the report files."""

import json

import pytest


@pytest.mark.e2e
def test_vision_bench_smoke(tmp_path):
    from bench.workloads.vision import KINDS
    from launcher.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--workload", "vision", "--model", "tiny", "--vision-concurrency", "1,2", "--vision-turn", "2"]
    argv += ["--vision-rounds", "1", "--vision-output-tokens", "4", "--vision-streams", "2"]
    argv += [
        "--vision-stream-tokens",
        "2000",
        "--vision-flood-rate",
        "8",
        "--vision-flood-rounds",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    prompt = results["prompt_tokens"]
    assert prompt["image"] - prompt["text"] >= 576  # the image's placeholder became its 576 tokens (+ its line)
    rows = {(r["concurrency"], r["kind"]): r for r in results["levels"]}
    assert set(rows) == {(c, k) for c in (1, 2) for k in KINDS}
    for (c, kind), r in rows.items():
        assert r["errors"] == 0 and r["requests"] == 2 and r["output_tokens"] == 8 and r["ttft_p50_ms"] > 0
        assert r["counted_requests"] >= 2
        if kind == "image":
            assert r["images_per_request"] == 1.0 and r["preprocess_ms_per_image"] > 0
            assert r["prompt_tokens"] == prompt["image"]
        else:
            assert r["images_per_request"] == 0.0
        if c == 1:  # the encoder ran once per image request, and only for them
            assert r["encoder_steps"] == (2 if kind == "image" else 0)
    assert rows[(1, "image")]["encode_ms_per_image"] > 0
    assert rows[(1, "text, same tokens")]["prompt_tokens"] == prompt["image"]
    flood = results["flood"]
    assert flood["alone"]["images_sent"] == 0 and flood["alone"]["gaps"] > 0
    assert (
        flood["flood"]["images_sent"] > 0 and flood["flood"]["images_preprocessed"] > 0 and flood["flood"]["gaps"] > 0
    )
    assert flood["flood"]["cpu_per_s"].get("tokenizer", 0) > 0
    assert flood["ratio_mean"] > 0  # the tiny model's tokens often share an event: its p50 gap may be 0
    md = (out / "results.md").read_text()
    assert "| 2 | image |" in md and "| 1 | text, same tokens |" in md and "Gap with the flood / alone" in md
    assert results["cpu"] in md and (out / "results.png").stat().st_size > 0
