"""Launcher flags: TGI names, environment fallbacks, derived limits and their checks."""

import json

import pytest

from launcher.cli import build_parser, settings_from
from libs.runtime.settings import Settings


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    return tmp_path


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_env_fallbacks(monkeypatch, model_dir):
    monkeypatch.setenv("MODEL_ID", str(model_dir))
    monkeypatch.setenv("PORT", "8081")
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "1000")
    args = parse()
    assert (args.model_id, args.port) == (str(model_dir), 8081)
    s = settings_from(args, model_dir)
    assert (s.max_total_tokens, s.max_input_tokens) == (1000, 999)
    assert parse("--port", "9000").port == 9000  # a flag beats its variable


def test_derived_defaults(model_dir):
    s = settings_from(parse(), model_dir)
    assert s.max_total_tokens == 2048  # min(4096, max_position_embeddings)
    assert s.max_batch_prefill_tokens == 4096 and s.max_batch_total_tokens == 65536
    assert s.num_blocks == 65536 // 16


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--max-input-tokens", "100", "--max-total-tokens", "100"], "must be < max_total_tokens"),
        (["--max-input-tokens", "10", "--max-input-length", "10"], "the same flag"),
        (["--max-input-tokens", "900", "--max-batch-prefill-tokens", "100"], "max_batch_prefill_tokens"),
        (["--max-total-tokens", "1000", "--max-batch-total-tokens", "500"], "max_batch_total_tokens"),
        (["--num-shard", "2"], "not implemented"),
    ],
)
def test_inconsistent_limits_are_refused(model_dir, argv, fragment):
    with pytest.raises(SystemExit, match=fragment):
        settings_from(parse(*argv), model_dir)


def test_hostname_that_is_not_an_address_falls_back(model_dir):
    assert settings_from(parse("--hostname", "my-container"), model_dir).hostname == "0.0.0.0"
    assert settings_from(parse("--hostname", "::1"), model_dir).hostname == "::1"


def test_settings_travel_through_the_environment():
    s = Settings(bus="ipc:///tmp/x", model_path="/m", port=1234, max_batch_size=7)
    assert Settings.from_env(s.to_env()) == s
