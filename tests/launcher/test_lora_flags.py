"""`--lora-adapters`: TGI's syntax and message, and resolution to folders (local, and a Hub cache read offline)."""

from __future__ import annotations

import pytest

from launcher.lora_flags import AdapterSpec, LoraFlagError, from_flag_or_env, parse_lora_adapters, resolve, resolve_all
from tests.launcher.serve_argv import parse


def test_the_three_forms_in_order():
    specs = parse_lora_adapters("org/a, org/b@v1.0 ,mine=/tmp/x")
    assert specs == [
        AdapterSpec("org/a", "org/a"),
        AdapterSpec("org/b", "org/b", revision="v1.0"),
        AdapterSpec("mine", "/tmp/x", local=True),
    ]


@pytest.mark.parametrize("value", [None, "", "  "])
def test_nothing_given_is_no_adapter(value):
    assert parse_lora_adapters(value) == []


@pytest.mark.parametrize(
    "value, entry",
    [("a=b=c", "a=b=c"), ("x, a@b@c", "a@b@c"), ("=path", "=path"), ("@rev", "@rev"), ("a,,b", "")]
    + [("name=", "name="), ("id@", "id@"), ("a=@r", "a=@r")],
)
def test_malformed_entry_gets_tgis_message(value, entry):
    with pytest.raises(LoraFlagError) as e:
        parse_lora_adapters(value)
    assert str(e.value) == f"Invalid LoRA adapter format: {entry}"


def test_stricter_than_tgi():
    with pytest.raises(LoraFlagError, match="applies to Hub ids"):
        parse_lora_adapters("n=/some/path@main")
    with pytest.raises(LoraFlagError, match="given twice"):
        parse_lora_adapters("a=/x,a=/y")
    with pytest.raises(LoraFlagError, match="reserved for the base model"):
        parse_lora_adapters("tgi=/x")


def test_flag_wins_over_env():
    env = {"LORA_ADAPTERS": "e=/env"}
    assert from_flag_or_env(None, env) == [AdapterSpec("e", "/env", local=True)]
    assert from_flag_or_env("f=/flag", env) == [AdapterSpec("f", "/flag", local=True)]


def test_local_folder(tmp_path):
    (tmp_path / "ad").mkdir()
    spec = parse_lora_adapters(f"x={tmp_path / 'ad'}")[0]
    assert resolve(spec) == (tmp_path / "ad").resolve()
    with pytest.raises(LoraFlagError, match="'y': folder .* does not exist"):
        resolve(parse_lora_adapters(f"y={tmp_path / 'missing'}")[0])


def _fake_hub_cache(root, repo: str, commit: str, ref: str = "main"):
    """The layout huggingface_hub's cache keeps for a downloaded snapshot."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "adapter_config.json").write_text("{}")
    (snap / "adapter_model.safetensors").write_bytes(b"")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(commit)
    return snap


def test_hub_id_resolves_from_the_cache_offline(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = _fake_hub_cache(tmp_path, "org/adapter", commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve(parse_lora_adapters("org/adapter")[0]) == snap
    assert resolve_all(parse_lora_adapters(f"org/adapter@{commit}")) == {"org/adapter": snap}
    with pytest.raises(LoraFlagError, match=r"'org/adapter' \(revision 'v2'\) is not available from the local cache"):
        resolve(parse_lora_adapters("org/adapter@v2")[0])


def test_serve_resolves_adapters_into_settings(tmp_path, model_dir, monkeypatch):
    from launcher.cli import settings_from

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    s = settings_from(parse("--lora-adapters", f"a={tmp_path / 'a'},b={tmp_path / 'b'}", "--max-loras", "3"), model_dir)
    assert s.lora_adapters == f"a={(tmp_path / 'a').resolve()},b={(tmp_path / 'b').resolve()}"
    assert (s.lora_names, s.max_loras, s.max_lora_rank, s.lora_fold) == (["a", "b"], 3, 64, True)
    assert not settings_from(parse("--disable-lora-fold"), model_dir).lora_fold
    assert settings_from(parse(), model_dir).lora_names == []
    monkeypatch.setenv("LORA_ADAPTERS", f"c={tmp_path / 'a'}")  # the variable, when no flag is given
    assert settings_from(parse(), model_dir).lora_names == ["c"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a=/x=y", "error: Invalid LoRA adapter format: a=/x=y"),
        ("a=/no/such/folder", "error: LoRA adapter 'a': folder /no/such/folder does not exist"),
    ],
)
def test_serve_refuses_bad_adapters(model_dir, value, message):
    from launcher.cli import settings_from

    with pytest.raises(SystemExit) as e:
        settings_from(parse("--lora-adapters", value), model_dir)
    assert str(e.value.code) == message  # SystemExit with a text: printed, exit status 1


def test_serve_refuses_more_adapters_than_max_loras(tmp_path, model_dir):
    from launcher.cli import settings_from

    (tmp_path / "a").mkdir()
    with pytest.raises(SystemExit, match="more than --max-loras 1"):
        settings_from(parse("--lora-adapters", f"a={tmp_path / 'a'},b={tmp_path / 'a'}", "--max-loras", "1"), model_dir)
