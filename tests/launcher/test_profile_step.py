"""launcher.bench.profile_step's join probe on a tiny model: decode steps of the batch alone, alternated with the
same steps carrying one fresh prompt's prefill (timings are reported, not tested)."""

from launcher.bench import profile_step
from tests.tiny_models import build_model


def test_a_joining_prompt_is_fed_beside_the_decode_rows(tmp_path):
    folder = build_model(tmp_path / "tiny-llama", "llama")
    got = profile_step.joined(str(folder), batch=3, prompt_tokens=8, join_tokens=5, steps=6, dtype="float32")
    assert got["tokens"] == {"decode": [3], "with a join": [3 + 5]}  # the join fired, every other step
    assert got["decode"] > 0 and got["with a join"] > 0
