"""The bus's flags: a host-less --bus-address binds loopback, a plaintext tcp bus is refused unless --bus-insecure
(and then warned about if exposed), CURVE keys from a flag, either of their environment variables or a keygen file
(checked, never echoed), client keys and the allowed-keys list, and `switchyard keygen` itself."""

from __future__ import annotations

import logging
import stat

import pytest
import zmq

from launcher import bus_flags, keygen, tap
from launcher.cli import main, programs, settings_from
from libs.runtime import bus, bus_auth
from tests.launcher.serve_argv import parse

SECRET_VAR, PUBLIC_VAR = bus_flags.SECRET_VAR, bus_flags.PUBLIC_VAR
# the variables the launcher's rule gives the key flags (--bus-curve-secret-key ← BUS_CURVE_SECRET_KEY, …)
RULE_VARS = ("BUS_CURVE_SECRET_KEY", "BUS_CURVE_PUBLIC_KEY", "BUS_CURVE_CLIENT_KEY", "BUS_CURVE_ALLOWED_KEYS")


@pytest.fixture(autouse=True)
def no_keys_in_env(monkeypatch):
    for var in (SECRET_VAR, PUBLIC_VAR, "BUS_ADDRESS", *RULE_VARS, bus_flags.CLIENT_SECRET_VAR, "BUS_INSECURE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("SWITCHYARD_CURVE_ALLOWED_KEYS", "SWITCHYARD_BUS_INSECURE"):
        monkeypatch.delenv(var, raising=False)


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


def test_a_plaintext_tcp_bus_is_refused_unless_asked_for(model_dir, caplog, monkeypatch):
    for address in ("5550", "tcp://0.0.0.0:5550"):  # loopback too: any local user could reach it
        with pytest.raises(SystemExit, match="in the clear.*--bus-insecure"):
            _check(model_dir, caplog, "--bus-address", address)
    assert _check(model_dir, caplog)[1] == []  # ipc: the private run directory, no key needed
    settings, warnings = _check(model_dir, caplog, "--bus-address", "5550", "--bus-insecure")
    assert settings.bus_insecure and warnings == [] and "in the clear on loopback" in caplog.text
    monkeypatch.setenv("BUS_INSECURE", "1")  # the flag's variable, by the launcher's rule
    assert _check(model_dir, caplog, "--bus-address", "5550")[0].bus_insecure
    monkeypatch.delenv("BUS_INSECURE")
    monkeypatch.setenv("SWITCHYARD_BUS_INSECURE", "1")  # and the services' own
    assert _check(model_dir, caplog, "--bus-address", "5550")[0].bus_insecure


def test_exposed_plaintext_bus_warns(model_dir, caplog, monkeypatch):
    _, warnings = _check(model_dir, caplog, "--bus-insecure", "--bus-address", "tcp://0.0.0.0:5550")
    assert len(warnings) == 1 and "plaintext" in warnings[0].getMessage() and "0.0.0.0" in warnings[0].getMessage()
    _, warnings = _check(model_dir, caplog, "--bus-insecure", "--bus-address", "tcp://:5550?replicas=gpu-box:5560")
    assert len(warnings) == 1 and "gpu-box" in warnings[0].getMessage()
    assert _check(model_dir, caplog, "--bus-insecure", "--bus-address", "5550")[1] == []  # loopback: no warning
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
    # with "=": a Z85 key may begin with "-", which argparse would take for a flag
    _, warnings = _check(model_dir, caplog, f"--bus-curve-secret-key={secret}")
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


@pytest.mark.parametrize(
    "rule_var,field_var", [("BUS_CURVE_SECRET_KEY", SECRET_VAR), ("BUS_CURVE_PUBLIC_KEY", PUBLIC_VAR)]
)
def test_each_key_is_read_under_both_its_names(model_dir, caplog, monkeypatch, rule_var, field_var):
    public, secret = bus.curve_keypair()
    key = secret if "SECRET" in rule_var else public
    only = None if "SECRET" in rule_var else "shard,tokenizer,detokenizer,http"
    for var in (rule_var, field_var):
        monkeypatch.setenv(var, key)
        settings, _ = _check(model_dir, caplog, "--bus-address", "5550", only=only)
        assert settings.curve_public_key == public and settings.curve_secret_key == (key if key == secret else "")
        assert not settings.bus_insecure  # a key, not --bus-insecure, is what let the tcp bus start
        monkeypatch.delenv(var)
    monkeypatch.setenv(rule_var, key)
    monkeypatch.setenv(field_var, bus.curve_keypair()[0 if key == public else 1])
    with pytest.raises(SystemExit, match=f"{rule_var} and {field_var} are both set and differ") as err:
        parse()
    assert key not in str(err.value)


def test_client_key_and_allowed_keys(model_dir, tmp_path, caplog, monkeypatch, capsys):
    public, secret = bus.curve_keypair()
    client = tmp_path / "client.key"
    assert keygen.main(["keygen", "--client", "--out", str(client)][1:]) == 0
    lines = client.read_text().splitlines()
    assert lines[0].startswith("# bus client key, fingerprint ")
    values = dict(line.split("=", 1) for line in lines[1:])
    client_public = values[bus_flags.CLIENT_PUBLIC_VAR].strip("'")
    client_secret = values[bus_flags.CLIENT_SECRET_VAR].strip("'")
    assert zmq.curve_public(client_secret.encode()).decode() == client_public
    assert lines[0].endswith(bus_auth.fingerprint(client_public))
    allowed = tmp_path / "allowed"
    allowed.write_text(f"# the tap host\n{lines[1]}\n{bus.curve_keypair()[0]}  old key, rotating out\n")
    monkeypatch.setenv(SECRET_VAR, secret)
    argv = ("--bus-address", "5550", "--bus-curve-client-key", str(client), "--bus-curve-allowed-keys", str(allowed))
    settings, warnings = _check(model_dir, caplog, *argv)
    assert settings.curve_client_secret_key == client_secret and settings.curve_allowed_keys == str(allowed)
    assert warnings == [] and "only the keys in" in caplog.text and client_secret not in caplog.text
    assert client_public in bus_auth.read_keys(str(allowed))
    monkeypatch.setenv("BUS_CURVE_ALLOWED_KEYS", str(allowed))  # the flag's variable
    assert _check(model_dir, caplog, "--bus-address", "5550")[0].curve_allowed_keys == str(allowed)
    # a list holding a secret line, or a line that is no key, stops the launcher without echoing the line
    for bad in (client.read_text(), "not-a-key\n"):
        allowed.write_text(bad)
        with pytest.raises(SystemExit, match=r"line \d") as err:
            _check(model_dir, caplog, *argv)
        assert client_secret not in str(err.value)
    with pytest.raises(SystemExit, match="--bus-curve-allowed-keys"):
        _check(model_dir, caplog, "--bus-address", "5550", "--bus-curve-allowed-keys", str(tmp_path / "none"))
