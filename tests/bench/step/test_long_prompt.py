"""The long-prompt workload's in-process half (bench/step/long_prompt.py) on the tiny bench model: the prefill cap
while decoding feeds the long prompt in chunks beside every stream, and one prompt is fed chunk by chunk with its
memory read (timings are reported, not tested; the whole workload: tests/bench/workloads/test_long_prompt.py)."""

from bench import models
from bench.step import long_prompt


def test_the_cap_feeds_the_long_prompt_in_chunks():
    _, view = models.resolve("tiny")
    none, capped = long_prompt.chunk_sweep(view, "float32", ["0", "128"], 3, 300)
    assert none["chunks"] == [300] and capped["chunks"] == [128, 128, 44]
    assert capped["streams"] == 3 and capped["itl_during_max_ms"] > 0 and capped["cpu_during_p50_ms"] >= 0


def test_the_memory_probe_reads_each_chunk():
    _, view = models.resolve("tiny")
    got = long_prompt.memory_probe(view, "float32", 100, 48)
    assert [(c["context"], c["tokens"]) for c in got["chunks"]] == [(0, 48), (48, 48), (96, 4)]
    assert got["token"] is not None and got["loaded_rss_mib"] > 0
