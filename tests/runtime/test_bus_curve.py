"""The bus's socket options: bounded queues everywhere, and opt-in CURVE encryption for tcp links
(two real sockets on loopback)."""

from __future__ import annotations

import socket as pysocket

import pytest
import zmq

from libs.protocol.messages import Hello
from libs.runtime import bus
from libs.runtime.settings import Settings


def loopback() -> str:
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


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
    connector = bus.Curve.from_settings(Settings.from_env({"SWITCHYARD_CURVE_SERVER_KEY": public}))
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
