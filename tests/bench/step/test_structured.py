"""The structured step benchmark (bench/step/structured.py) on the tiny bench model: constrained decode steps
through the in-process engine against unconstrained ones, masks filled ahead and inline; and the token choice
alone (timings are reported, not tested)."""

from bench.step import structured
from bench.workloads.structured import model_folder


def test_the_constrained_steps_apply_masks_and_the_unconstrained_none():
    _, folder = model_folder("tiny")  # its own folder: the grammar ends on its EOS ids
    out = structured.measure(str(folder), 2, 3, prompt_tokens=16, rounds=1)
    (run,) = out["runs"]
    assert run["constrained"]["apply_ms_per_step"] > 0 and run["inline"]["apply_ms_per_step"] > 0
    assert run["unconstrained"]["apply_ms_per_step"] == 0 and run["unconstrained"]["row_errors"] == 0
    assert out["ratio"] > 0 and out["ratio_inline"] > 0


def test_the_choice_alone():
    _, folder = model_folder("tiny")
    out = structured.measure_choice(str(folder), 2, 3, rounds=1)
    (run,) = out["runs"]
    assert run["constrained"]["path_ms_per_step"] > 0 and out["vocab"] > 0
