"""The bus's place and its keys, from the launcher's flags: --bus-address, --bus-curve-secret-key,
--bus-curve-public-key, --bus-curve-client-key, --bus-curve-allowed-keys, --bus-insecure (and the tap's keys).

Loopback unless told otherwise: a host-less --bus-address (`5550`, `:5550`, `tcp://:5550`, and each
host-less `:port` of `?replicas=`) means 127.0.0.1. A host named explicitly (an interface's IP,
0.0.0.0, a name) is used as given, never widened. A tcp bus without a key is refused unless --bus-insecure
says it is meant (the services refuse it too); with it, a bus that leaves the host is still warned about.

Keys are Z85 text (`switchyard keygen`); a flag takes the key itself or a file holding it (keygen's
output, or the bare key). Each key flag reads the variable the launcher's rule gives it (--bus-curve-secret-key
← BUS_CURVE_SECRET_KEY) and the services' own (SWITCHYARD_CURVE_SECRET_KEY), which keygen writes; set both
and they must agree. Errors never echo what was given, since it may be the secret.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

from libs.protocol import Addresses
from libs.runtime import bus, bus_auth
from libs.runtime.settings import Settings, env_name, env_value

log = logging.getLogger("switchyard.launcher")
LOOPBACK = "127.0.0.1"
SECRET_VAR = env_name("curve_secret_key")  # the environment of the launcher and of every service alike
PUBLIC_VAR = env_name("curve_public_key")
CLIENT_SECRET_VAR = env_name("curve_client_secret_key")
CLIENT_PUBLIC_VAR = env_name("curve_client_public_key")  # keygen --client's public line (no setting: derived)
BINDERS = ("router", "scheduler")  # the programs that bind the bus (the CURVE servers)


def _with_host(host_port: str) -> str:
    """`port` or `:port` → `127.0.0.1:port`; anything else unchanged."""
    if host_port.isdigit():
        return f"{LOOPBACK}:{host_port}"
    if host_port.startswith(":") and host_port[1:].isdigit():
        return LOOPBACK + host_port
    return host_port


def bus_address(spec: str | None, flag: str = "--bus-address") -> str:
    """--bus-address as the services take it ("" = ipc in the run directory), host-less parts on loopback."""
    if not spec:
        return ""
    if spec.isdigit() or spec.startswith(":"):
        spec = "tcp://" + spec
    if not spec.startswith("tcp://"):
        raise SystemExit(f"error: {flag} must be tcp://host:port (or a port: 127.0.0.1), got {spec!r}")
    main, sep, query = spec[len("tcp://") :].partition("?")
    key, eq, value = query.partition("=")
    if sep and key == "replicas" and eq:
        query = ",".join(_with_host(item) for item in value.split(","))
        query = f"replicas={query}"
    spec = f"tcp://{_with_host(main)}{sep}{query}"
    try:
        Addresses.parse(spec)
    except ValueError as e:
        raise SystemExit(f"error: {flag}: {e}") from None
    return spec


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def exposed_hosts(spec: str) -> list[str]:
    """The hosts of a tcp bus that are not loopback (where its traffic may leave this host)."""
    if not spec.startswith("tcp://"):
        return []
    a = Addresses.parse(spec)
    hosts = [a.where, *(h for h, _ in a.replica_hosts)]
    return sorted({h for h in hosts if not is_loopback(h)})


def env_default(flag: str, field: str) -> str | None:
    """A security flag's value from the environment, under both names it is documented by: the launcher's rule
    for every flag (`--bus-curve-secret-key` ← BUS_CURVE_SECRET_KEY) and the services' own SWITCHYARD_<FIELD>.
    Both set to different values is refused (which one was meant?), naming the variables, never the values."""
    rule = flag.removeprefix("--").upper().replace("-", "_")
    found = {name: v for name, v in ((rule, os.environ.get(rule)), (env_name(field), env_value(field))) if v}
    if len(set(found.values())) > 1:
        raise SystemExit(f"error: {' and '.join(found)} are both set and differ; set one of them")
    return next(iter(found.values()), None)


def read_key(value: str | None, var: str, flag: str) -> str:
    """A key given as itself or as a file holding it: a bare key, or `VAR='key'` lines (keygen's output)."""
    if not value:
        return ""
    path = Path(value)
    if not path.is_file():  # a file first: a 40-character path would pass for a key
        if bus.is_key(value):
            return value
        raise SystemExit(f"error: {flag}: neither a 40-character Z85 key nor a readable file holding one")
    text = path.read_text(encoding="utf-8", errors="replace")
    key = text.strip()
    for line in text.splitlines():
        name, eq, rest = line.partition("=")
        if eq and name.strip().removeprefix("export ").strip() == var:
            key = rest.strip().strip("'\"")
    if not bus.is_key(key):
        raise SystemExit(f"error: {flag}: the file {value} holds no 40-character Z85 key ({var}=… or the key alone)")
    return key


def curve_keys(secret_arg: str | None, public_arg: str | None) -> tuple[str, str]:
    """(secret, public) from the flags, checked: the public half is derived from the secret, or must match it."""
    secret = read_key(secret_arg, SECRET_VAR, "--bus-curve-secret-key")
    public = read_key(public_arg, PUBLIC_VAR, "--bus-curve-public-key")
    if secret_arg and secret == secret_arg and secret_arg != env_default("--bus-curve-secret-key", "curve_secret_key"):
        log.warning(
            "--bus-curve-secret-key given on the command line is visible to every user of this host (ps); "
            "prefer %s or a file (switchyard keygen --out FILE)",
            SECRET_VAR,
        )
    try:
        curve = bus.Curve.from_keys(secret, public)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None
    return (curve.server_secret, curve.server_public) if curve else ("", "")


def client_key(value: str | None) -> str:
    """--bus-curve-client-key: a client secret key, or a file holding it (keygen --client's output)."""
    return read_key(value, CLIENT_SECRET_VAR, "--bus-curve-client-key")


def allowed_keys(value: str | None) -> str:
    """--bus-curve-allowed-keys FILE, as an absolute path (the services run elsewhere), its keys read now so a
    malformed list stops the launcher instead of every binder."""
    if not value:
        return ""
    path = Path(value).resolve()
    try:
        keys = bus_auth.read_keys(str(path))
    except OSError as e:
        raise SystemExit(f"error: --bus-curve-allowed-keys {value}: {e.strerror}") from None
    except ValueError as e:
        raise SystemExit(f"error: --bus-curve-allowed-keys: {e}") from None
    if not keys:
        log.warning("--bus-curve-allowed-keys %s lists no key: only hosts holding the secret can connect", value)
    return str(path)


def check(settings: Settings, counts: dict[str, int]) -> None:
    """Refuse a binder here without the secret, a plaintext tcp bus not asked for (--bus-insecure), and client
    authentication that cannot work; warn about a plaintext bus that leaves the host."""
    curve = bool(settings.curve_public_key)
    if not settings.bus.startswith("tcp://"):
        if curve:
            log.info("CURVE applies to a tcp bus; this one is ipc in the private run directory and stays on the host")
        return
    binders = [role for role in BINDERS if counts.get(role)]
    connectors = [role for role, n in counts.items() if n and role not in BINDERS]
    if curve and not settings.curve_secret_key and binders:
        raise SystemExit(
            f"error: {', '.join(binders)} bind the bus here and need the secret key (--bus-curve-secret-key); "
            "--bus-curve-public-key alone is for hosts that only connect"
        )
    if not curve and not settings.bus_insecure:
        raise SystemExit(
            f"error: the bus {settings.bus} would carry every prompt and token in the clear, and anyone who reaches "
            "its ports could read them and inject messages. Give it a key (switchyard keygen --out bus.key; "
            "--bus-curve-secret-key bus.key), or pass --bus-insecure (env BUS_INSECURE=1) to run it in the clear "
            "on purpose"
        )
    if settings.curve_allowed_keys and not binders:
        log.info("--bus-curve-allowed-keys is for the hosts that bind the bus (router, scheduler); none runs here")
    if curve and not settings.curve_secret_key and not settings.curve_client_secret_key and connectors:
        log.info(
            "no client key (--bus-curve-client-key): %s connect with fresh keys, which a bus that lists its "
            "allowed clients (--bus-curve-allowed-keys) refuses",
            ", ".join(connectors),
        )
    exposed = exposed_hosts(settings.bus)
    if curve:
        log.info("bus links encrypted with CURVE (server public key %s)", settings.curve_public_key)
        if settings.curve_allowed_keys and binders:
            log.info("bus clients authenticated: only the keys in %s are let in", settings.curve_allowed_keys)
    elif exposed:
        log.warning(
            "the bus (%s) names %s, not loopback: its traffic is plaintext and unauthenticated, so anyone who "
            "reaches these ports can read every prompt and token and inject messages. Give it a key "
            "(switchyard keygen; --bus-curve-secret-key) or keep it on a private network",
            settings.bus,
            ", ".join(exposed),
        )
    else:
        log.info("the bus runs in the clear on loopback (--bus-insecure)")
