"""The bus's socket options: bounded queues everywhere, and CURVE on tcp links (real sockets on loopback):
a CURVE pair talks, a plaintext client or one trusting another key gets nothing through, and once a process
has a key (bus.configure, or its environment) every tcp socket it makes is encrypted while ipc stays plain; a tcp
socket without a key is refused unless the process is told a plaintext bus is meant. With an allowed-keys list
(the ZAP handler, libs/runtime/bus_auth.py) only listed clients and the deployment's own key get through, the list
is re-read when it changes (rotation), and a refused key is logged once, by its fingerprint."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from libs.protocol.messages import Hello
from libs.runtime import bus, bus_auth
from libs.runtime.settings import Settings
from tests.ports import free_port


def loopback() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_every_bus_socket_is_bounded():
    """A zero HWM would be an unbounded queue; admission bounds the load, the HWMs bound the memory."""
    sock = bus.socket(zmq.PUSH)
    try:
        assert 0 < sock.getsockopt(zmq.SNDHWM) <= 1_000_000
        assert 0 < sock.getsockopt(zmq.RCVHWM) <= 1_000_000
        assert sock.getsockopt(zmq.LINGER) == 0
    finally:
        sock.close()


def test_curve_from_settings():
    public, secret = bus.curve_keypair()
    assert len(public) == len(secret) == 40
    assert bus.Curve.from_settings(Settings()) is None
    binder = bus.Curve.from_settings(Settings(curve_secret_key=secret))
    assert binder == bus.Curve(server_public=public, server_secret=secret)  # the public half is derived
    connector = bus.Curve.from_settings(Settings.from_env({"SWITCHYARD_CURVE_PUBLIC_KEY": public}))
    assert connector == bus.Curve(server_public=public)
    with pytest.raises(ValueError):
        bus.secure(bus.socket(zmq.PULL), connector, server=True)  # a binder without the secret


def _delivered(server: bus.Curve | None, client: bus.Curve | None, timeout_ms: int = 1500) -> bool:
    """Does a message PUSHed by a client reach a PULL server bound on loopback?"""
    addr = loopback()
    pull = bus.socket(zmq.PULL, bind=addr, curve=server)
    push = bus.socket(zmq.PUSH, connect=addr, curve=client)
    try:
        bus.send(push, Hello(nonce="secret-handshake"))
        if not pull.poll(timeout_ms):
            return False
        msg = bus.recv(pull)
        return isinstance(msg, Hello) and msg.nonce == "secret-handshake"
    finally:
        push.close()
        pull.close()


def test_curve_link_on_loopback():
    public, secret = bus.curve_keypair()
    server = bus.Curve(server_public=public, server_secret=secret)
    assert _delivered(server, bus.Curve(server_public=public))
    # a client that trusts another key, or speaks plaintext, never gets a message through
    other_public, _ = bus.curve_keypair()
    assert not _delivered(server, bus.Curve(server_public=other_public))
    assert not _delivered(server, None)
    assert _delivered(None, None)  # and without CURVE on either side the bus works as before


@pytest.fixture
def unconfigured(monkeypatch):
    """This process's bus key as at start (none yet), restored afterwards."""
    monkeypatch.setattr(bus, "_curve", bus._UNSET)
    monkeypatch.setattr(bus, "_plaintext_ok", False)
    for var in ("SWITCHYARD_CURVE_SECRET_KEY", "SWITCHYARD_CURVE_PUBLIC_KEY"):
        monkeypatch.delenv(var, raising=False)


def _roundtrip(bind_addr: str, connect_addr: str, timeout_ms: int = 1500) -> bool:
    """PUSH → PULL with the process's configured key (no curve= given)."""
    pull = bus.socket(zmq.PULL, bind=bind_addr)
    push = bus.socket(zmq.PUSH, connect=connect_addr)
    try:
        bus.send(push, Hello(nonce="n"))
        return bool(pull.poll(timeout_ms)) and isinstance(bus.recv(pull), Hello)
    finally:
        push.close()
        pull.close()


def test_configured_key_applies_to_every_tcp_socket(unconfigured, tmp_path):
    public, secret = bus.curve_keypair()
    assert bus.configure(Settings(curve_secret_key=secret)) == bus.Curve(server_public=public, server_secret=secret)
    addr = loopback()
    pull = bus.socket(zmq.PULL, bind=addr)
    push = bus.socket(zmq.PUSH, connect=addr)
    try:
        assert pull.getsockopt(zmq.MECHANISM) == zmq.CURVE and pull.getsockopt(zmq.CURVE_SERVER) == 1
        assert push.getsockopt(zmq.MECHANISM) == zmq.CURVE and push.getsockopt(zmq.CURVE_SERVER) == 0
    finally:
        push.close()
        pull.close()
    other = loopback()  # a closed socket's port is released asynchronously
    assert _roundtrip(other, other)
    # a peer that never heard of the key (an explicit plaintext socket) gets nothing through
    assert not _delivered(bus.configured(), None)
    ipc = f"ipc://{tmp_path}/sock"  # the run directory is private: ipc stays plaintext
    sock = bus.socket(zmq.PULL, bind=ipc)
    try:
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        sock.close()
    assert _roundtrip(ipc, ipc)


def test_key_from_the_environment(unconfigured, monkeypatch):
    """A process that never calls configure() (http) takes the key from SWITCHYARD_CURVE_* on first use."""
    public, secret = bus.curve_keypair()
    monkeypatch.setenv("SWITCHYARD_CURVE_PUBLIC_KEY", public)
    sock = bus.socket(zmq.PUSH, connect=loopback())
    try:
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
    finally:
        sock.close()
    # with the public key only, a binder cannot serve: refused loudly, not silently plaintext
    with pytest.raises(ValueError, match="secret key"):
        bus.socket(zmq.PULL, bind=loopback())


def test_without_a_key_tcp_is_refused_unless_plaintext_is_meant(unconfigured, tmp_path):
    assert bus.configure(Settings()) is None
    with pytest.raises(bus.PlaintextRefused, match="--bus-insecure"):
        bus.socket(zmq.PULL, bind=loopback())
    bus.socket(zmq.PULL, bind=f"ipc://{tmp_path}/sock").close()  # ipc needs no key
    assert bus.configure(Settings(bus_insecure=True)) is None
    sock = bus.socket(zmq.PULL, bind=loopback())
    try:
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        sock.close()


def test_bad_keys_are_refused_without_echoing_them():
    public, secret = bus.curve_keypair()
    other_public, _ = bus.curve_keypair()
    for kwargs in ({"secret": secret[:-1]}, {"public": public + "x"}, {"secret": secret, "public": other_public}):
        with pytest.raises(ValueError) as err:
            bus.Curve.from_keys(**kwargs)
        assert secret[:10] not in str(err.value) and public[:10] not in str(err.value)
    assert bus.Curve.from_keys(secret, public) == bus.Curve(server_public=public, server_secret=secret)


def test_the_secret_stays_out_of_reprs():
    public, secret = bus.curve_keypair()
    assert secret not in repr(bus.Curve(server_public=public, server_secret=secret))
    assert public in repr(bus.Curve(server_public=public, server_secret=secret))
    assert secret not in repr(Settings(curve_secret_key=secret))


def _client_gets_through(addr: str, server_public: str, client_secret: str, pull: zmq.Socket) -> bool:
    push = bus.socket(zmq.PUSH, connect=addr, curve=bus.Curve(server_public=server_public, client_secret=client_secret))
    try:
        bus.send(push, Hello(nonce=client_secret[:8]))
        return bool(pull.poll(800)) and isinstance(bus.recv(pull), Hello)
    finally:
        push.close()


def test_only_listed_clients_get_through_and_keys_rotate(tmp_path, caplog):
    public, secret = bus.curve_keypair()
    (old_public, old_secret), (new_public, new_secret) = bus.curve_keypair(), bus.curve_keypair()
    stranger_public, stranger_secret = bus.curve_keypair()
    allowed = tmp_path / "allowed-keys"
    allowed.write_text(f"# clients of the bus\n{old_public}  the tap host\n")
    server = bus.Curve(server_public=public, server_secret=secret, allowed_keys=str(allowed))
    ctx = zmq.Context()  # a ZAP handler belongs to one context: this test's own
    addr = loopback()
    pull = bus.socket(zmq.PULL, bind=addr, ctx=ctx, curve=server)
    try:
        with caplog.at_level(logging.WARNING, logger="switchyard.bus"):
            assert _client_gets_through(addr, public, old_secret, pull)
            assert not _client_gets_through(addr, public, stranger_secret, pull)
            assert not _client_gets_through(addr, public, new_secret, pull)
            assert _client_gets_through(addr, public, secret, pull)  # a holder of the server secret: the deployment
            # rotation: the new key listed beside the old, then the old dropped; the file is re-read on change
            allowed.write_text(f"{old_public}\n{new_public}\n")
            assert _client_gets_through(addr, public, new_secret, pull)
            assert _client_gets_through(addr, public, old_secret, pull)
            allowed.write_text(f"{new_public}\n")
            assert not _client_gets_through(addr, public, old_secret, pull)
            assert _client_gets_through(addr, public, new_secret, pull)
            assert not _client_gets_through(addr, public, stranger_secret, pull)
        refusals = [r.getMessage() for r in caplog.records if "refused a bus client" in r.getMessage()]
        stranger, old = bus_auth.fingerprint(stranger_public), bus_auth.fingerprint(old_public)
        # each refused key logged by its fingerprint: the stranger once (its retries are quiet), the new key before
        # it was listed, the old one after it was dropped; never a key itself
        assert sum(stranger in m for m in refusals) == 2 and sum(old in m for m in refusals) == 1, refusals
        for key in (stranger_public, stranger_secret, old_secret, new_secret, secret):
            assert key not in caplog.text
    finally:
        pull.close()
        bus_auth.release(ctx)
        ctx.term()


def test_a_refused_client_retrying_is_logged_once(tmp_path, caplog):
    public, secret = bus.curve_keypair()
    stranger_public, stranger_secret = bus.curve_keypair()
    allowed = tmp_path / "allowed-keys"
    allowed.write_text("")
    ctx = zmq.Context()
    addr = loopback()
    server = bus.Curve(server_public=public, server_secret=secret, allowed_keys=str(allowed))
    pull = bus.socket(zmq.PULL, bind=addr, ctx=ctx, curve=server)
    push = bus.socket(zmq.PUSH, connect=addr, curve=bus.Curve(server_public=public, client_secret=stranger_secret))
    push.setsockopt(zmq.RECONNECT_IVL, 20)  # it retries the handshake every 20 ms
    try:
        with caplog.at_level(logging.WARNING, logger="switchyard.bus"):
            bus.send(push, Hello(nonce="n"))
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline and not pull.poll(100):
                pass
        assert not pull.poll(0)
        refusals = [r for r in caplog.records if bus_auth.fingerprint(stranger_public) in r.getMessage()]
        assert len(refusals) == 1
    finally:
        push.close()
        pull.close()
        bus_auth.release(ctx)
        ctx.term()


def test_allowed_keys_files():
    public, secret = bus.curve_keypair()
    tricky, _ = bus.curve_keypair()
    while "=" not in tricky:  # Z85 has `=`: a bare key holding one is still a key
        tricky, _ = bus.curve_keypair()
    text = f"# comment\n\n  {public} laptop\nexport SWITCHYARD_CURVE_CLIENT_PUBLIC_KEY='{tricky}'\n{tricky}\n"
    assert bus_auth.parse_keys(text, "f") == {public, tricky}
    with pytest.raises(ValueError, match="f line 2 names a secret") as err:
        bus_auth.parse_keys(f"{public}\nSWITCHYARD_CURVE_CLIENT_SECRET_KEY='{secret}'\n", "f")
    assert secret not in str(err.value)
    with pytest.raises(ValueError, match="f line 1: not a") as err:
        bus_auth.parse_keys(secret[:30] + "\n", "f")
    assert secret[:30] not in str(err.value)
