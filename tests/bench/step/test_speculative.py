"""The speculative step benchmark (bench/step/speculative.py) on the tiny bench model: decode steps through the
in-process engine with the drafts each configuration asks for, interleaved (timings are reported, not tested)."""

from bench import models
from bench.step import speculative


def test_each_configuration_drafts_its_positions():
    _, view = models.resolve("tiny")
    out = speculative.steps(str(view), 3, [(0, 0), (1, 2), (3, 1)], 2, "float32")
    rows = {(r["rows_drafted"], r["drafts_each"]): r for r in out["steps"]}
    assert [rows[c]["positions"] for c in ((0, 0), (1, 2), (3, 1))] == [3, 5, 6]
    assert rows[(0, 0)]["vs_plain"] == 1.0 and all(r["cpu_ms"] > 0 and r["wall_ms"] > 0 for r in rows.values())


def test_random_drafts_are_proposed_for_the_first_rows():
    import numpy as np

    drafter = speculative.RandomDrafts(100, np.random.default_rng(0))
    drafter.rows, drafter.each = 2, 3
    got = drafter.propose([None] * 5)
    assert set(got) == {0, 1} and all(len(d) == 3 and all(3 <= t < 100 for t in d) for d in got.values())
