"""The bus's flags: a host-less --bus-address binds loopback, an exposed plaintext bus is warned about, CURVE keys
from a flag, the environment or a keygen file (checked, never echoed), and `switchyard keygen` itself."""

from __future__ import annotations

import json
import logging
import stat

import pytest
import zmq

from launcher import bus_flags, keygen, tap
from launcher.cli import build_parser, main, programs, settings_from
from libs.runtime import bus

SECRET_VAR, PUBLIC_VAR = bus_flags.SECRET_VAR, bus_flags.PUBLIC_VAR


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    return tmp_path


@pytest.fixture(autouse=True)
def no_keys_in_env(monkeypatch):
    for var in (SECRET_VAR, PUBLIC_VAR, "BUS_ADDRESS"):
        monkeypatch.delenv(var, raising=False)


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "given,expected",
    [
        ("5550", "tcp://127.0.0.1:5550"),
        (":5550", "tcp://127.0.0.1:5550"),
        ("tcp://:5550", "tcp://127.0.0.1:5550"),
        ("tcp://:5550?replicas=:5560", "tcp://127.0.0.1:5550?replicas=127.0.0.1:5560"),
        ("tcp://:5550?replicas=10.0.0.2:5560,:5570", "tcp://127.0.0.1:5550?replicas=10.0.0.2:5560,127.0.0.1:5570"),
        # told otherwise: used exactly as given, never widened or narrowed
        ("tcp://0.0.0.0:5550", "tcp://0.0.0.0:5550"),
        ("tcp://10.0.0.1:5550?replicas=0.0.0.0:5560", "tcp://10.0.0.1:5550?replicas=0.0.0.0:5560"),
        ("tcp://[::1]:5550", "tcp://[::1]:5550"),
    ],
)
def test_a_host_left_out_is_loopback(model_dir, given, expected):
    assert bus_flags.bus_address(given) == expected
    assert settings_from(parse("--bus-address", given), model_dir).bus == expected


def test_bus_address_from_the_environment_and_default(monkeypatch, model_dir):
    assert settings_from(parse(), model_dir).bus == ""  # ipc in the run directory, named by serve()
    monkeypatch.setenv("BUS_ADDRESS", "tcp://:5555")
    assert settings_from(parse(), model_dir).bus == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize("bad", ["ipc:///tmp/x", "udp://1.2.3.4:5", "tcp://host", "tcp://h:1?replicas="])
def test_bad_bus_addresses_are_refused(model_dir, bad):
    with pytest.raises(SystemExit, match="--bus-address"):
        settings_from(parse("--bus-address", bad), model_dir)


def test_which_hosts_are_exposed():
    assert bus_flags.exposed_hosts("tcp://127.0.0.1:1?replicas=localhost:2,[::1]:3") == []
    assert bus_flags.exposed_hosts("tcp://0.0.0.0:1?replicas=10.0.0.2:2,router-host:3") == [
        "0.0.0.0",
        "10.0.0.2",
        "router-host",
    ]
    assert bus_flags.exposed_hosts("ipc:///tmp/x") == []


def _check(model_dir, caplog, *argv, only=None):
    args = parse(*argv, *(("--only", only) if only else ()))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="switchyard.launcher"):
        settings = settings_from(args, model_dir)
        bus_flags.check(settings, programs(args))
    return settings, [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_exposed_plaintext_bus_warns(model_dir, caplog, monkeypatch):
    _, warnings = _check(model_dir, caplog, "--bus-address", "tcp://0.0.0.0:5550")
    assert len(warnings) == 1 and "plaintext" in warnings[0].getMessage() and "0.0.0.0" in warnings[0].getMessage()
    _, warnings = _check(model_dir, caplog, "--bus-address", "tcp://:5550?replicas=gpu-box:5560")
    assert len(warnings) == 1 and "gpu-box" in warnings[0].getMessage()
    assert _check(model_dir, caplog, "--bus-address", "5550")[1] == []  # loopback: nothing to warn about
    assert _check(model_dir, caplog)[1] == []  # ipc
    public, secret = bus.curve_keypair()
    monkeypatch.setenv(SECRET_VAR, secret)  # with CURVE the exposed bus is fine
    settings, warnings = _check(model_dir, caplog, "--bus-address", "tcp://0.0.0.0:5550")
    assert warnings == [] and (settings.curve_secret_key, settings.curve_public_key) == (secret, public)
    assert secret not in caplog.text and public in caplog.text  # the public key is logged to check hosts agree


def test_keys_from_a_keygen_file(model_dir, tmp_path, capsys, caplog):
    path = tmp_path / "bus.key"
    assert main(["keygen", "--out", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(SystemExit, match="File exists"):  # never overwrites a key
        main(["keygen", "--out", str(path)])
    values = dict(line.split("=", 1) for line in path.read_text().splitlines())
    public, secret = (values[v].strip("'") for v in (PUBLIC_VAR, SECRET_VAR))
    assert zmq.curve_public(secret.encode()).decode() == public
    settings, warnings = _check(model_dir, caplog, "--bus-curve-secret-key", str(path), "--bus-address", "5550")
    assert (settings.curve_secret_key, settings.curve_public_key) == (secret, public) and warnings == []
    # a host that only connects takes the public line alone
    (tmp_path / "bus.pub").write_text(f"{PUBLIC_VAR}='{public}'\n")
    argv = ("--bus-curve-public-key", str(tmp_path / "bus.pub"), "--bus-address", "tcp://10.0.0.1:5550")
    settings, warnings = _check(model_dir, caplog, *argv, only="shard,tokenizer,detokenizer,http")
    assert (settings.curve_secret_key, settings.curve_public_key) == ("", public) and warnings == []
    # but the router and schedulers bind: they must hold the secret
    for binder in ("router", "scheduler"):
        with pytest.raises(SystemExit, match="need the secret key"):
            _check(model_dir, caplog, *argv, only=binder)
    assert secret not in caplog.text + capsys.readouterr().err


def test_keygen_prints_a_fresh_pair(capsys):
    assert keygen.main([]) == 0
    first = capsys.readouterr().out
    assert keygen.main([]) == 0
    assert capsys.readouterr().out != first
    lines = first.splitlines()
    assert [line.split("=")[0] for line in lines] == [PUBLIC_VAR, SECRET_VAR]
    public, secret = (line.split("=", 1)[1].strip("'") for line in lines)
    assert bus.is_key(public) and bus.is_key(secret) and zmq.curve_public(secret.encode()).decode() == public


def test_bad_keys_are_refused_without_echo(model_dir, caplog):
    public, secret = bus.curve_keypair()
    other_public, _ = bus.curve_keypair()
    cases = [
        ("--bus-curve-secret-key", secret[:-2] + "~~"),  # not Z85, not a file
        ("--bus-curve-secret-key", secret, "--bus-curve-public-key", other_public),  # not one keypair
    ]
    for argv in cases:
        with pytest.raises(SystemExit) as err:
            settings_from(parse(*argv), model_dir)
        assert secret[:12] not in str(err.value)


def test_a_secret_on_the_command_line_is_warned_about(model_dir, caplog, monkeypatch):
    public, secret = bus.curve_keypair()
    _, warnings = _check(model_dir, caplog, "--bus-curve-secret-key", secret)
    assert any("visible to every user" in w.getMessage() for w in warnings)
    assert secret not in caplog.text
    monkeypatch.setenv(SECRET_VAR, secret)
    assert _check(model_dir, caplog)[1] == []  # from the environment: quiet


def test_tap_key(monkeypatch, tmp_path):
    public, secret = bus.curve_keypair()
    assert tap.curve_from(None) is None
    assert tap.curve_from(public) == bus.Curve(server_public=public)
    monkeypatch.setenv(SECRET_VAR, secret)  # a host of the deployment: the public half of its secret
    assert tap.curve_from(None) == bus.Curve(server_public=public)  # a client: the secret is not kept
    (tmp_path / "k").write_text(public + "\n")
    assert tap.curve_from(str(tmp_path / "k")) == bus.Curve(server_public=public)
