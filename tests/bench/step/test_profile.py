"""The step profile (bench/step/profile.py) on a tiny model: every decode step split into its parts, and the join
probe: decode steps of the batch alone, alternated with the same steps carrying one fresh prompt's prefill
(timings are reported, not tested)."""

from bench.step import profile


def test_a_joining_prompt_is_fed_beside_the_decode_rows(tiny_dirs):
    folder = tiny_dirs["llama"]
    got = profile.joined(str(folder), batch=3, prompt_tokens=8, join_tokens=5, steps=6, dtype="float32")
    assert got["tokens"] == {"decode": [3], "with a join": [3 + 5]}  # the join fired, every other step
    assert got["decode"] > 0 and got["with a join"] > 0


def test_the_profile_splits_every_decode_step_into_its_parts(tiny_dirs):
    got = profile.profile(str(tiny_dirs["llama"]), 2, 8, 4, "float32")
    assert got["forward"] in ("walk", "transformers") and got["step_ms"] > 0
    assert set(got["parts_ms"]) == set(profile.PARTS) and got["parts_ms"]["layers"] > 0
