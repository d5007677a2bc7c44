"""Sockets on the bus; the event bus of the synchronous services (router, tokenizer, detokenizer, scheduler, shard).

Every process publishes on the event bus and subscribes to the topics it serves plus its own
heartbeat topic; `EventBus.start()` publishes a Hello on that topic until it comes back, which
proves both the publish path and the subscriptions are live before the process takes work. http's asyncio
twin, libs.runtime.async_bus.AsyncEventBus, shares all of that (`BusEnds`); docs/recovery.md tells what the
heartbeats are for.

Every socket comes from `socket()`, which turns CURVE on for tcp addresses when the process has a
bus key (`configure()`, or SWITCHYARD_CURVE_* in its environment): no service handles keys itself.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass

import zmq

from libs.protocol import Addresses, ProtocolError, codec, topics
from libs.protocol.message_base import Message
from libs.protocol.messages import Heartbeat, Hello
from libs.runtime import bus_auth, metrics
from libs.runtime.metrics_pacing import MetricsPacing
from libs.runtime.settings import Settings
from libs.runtime.timeouts import HEARTBEAT_S

log = logging.getLogger("switchyard.bus")

# Admission bounds what is in flight, so these only need to exceed the admitted load; a full
# queue blocks the sender instead of dropping (PUB drops past its HWM, hence large values).
HWM = 100_000


def context() -> zmq.Context:
    return zmq.Context.instance()


Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def is_key(text: str) -> bool:
    """Is `text` a CURVE key in Z85 text (40 characters of Z85's alphabet)?"""
    return len(text) == 40 and all(c in Z85 for c in text)


@dataclass(frozen=True)
class Curve:
    """ZeroMQ CURVE on the bus's tcp links. One keypair per deployment: every binding process (router,
    schedulers) serves with its secret half; a connecting process needs only the public half. This encrypts
    every link and authenticates the server (a client talks only to a holder of the secret). Clients are
    authenticated when the binders have a list of allowed client keys (`allowed_keys`, libs/runtime/bus_auth.py):
    a connecting process then presents its client keypair (`client_secret`; a holder of the server secret
    presents the deployment's own pair), else a fresh keypair per socket. ipc needs none: the run directory is
    0700."""

    server_public: str  # Z85, 40 characters
    server_secret: str = ""  # Z85; only on processes that bind
    client_secret: str = ""  # Z85; this process's client identity ("": the server pair, if held, else fresh)
    allowed_keys: str = ""  # a file of the client public keys the binders accept ("": any)

    def __repr__(self) -> str:  # never the secret, should a Curve reach a log line
        hidden = {name: "<set>" if getattr(self, name) else "" for name in ("server_secret", "client_secret")}
        return (
            f"Curve(server_public={self.server_public!r}, server_secret={hidden['server_secret']!r}, "
            f"client_secret={hidden['client_secret']!r}, allowed_keys={self.allowed_keys!r})"
        )

    @classmethod
    def from_keys(
        cls, secret: str = "", public: str = "", client_secret: str = "", allowed_keys: str = ""
    ) -> Curve | None:
        """None when neither server key is given; the public half is derived from the secret when only that is
        given, and must match it when both are (one keypair per deployment). Errors never echo a key."""
        if not secret and not public:
            if client_secret or allowed_keys:
                raise ValueError(
                    "a CURVE client key or allowed-keys list needs the bus's key (the public one at least)"
                )
            return None
        if client_secret and not is_key(client_secret):
            raise ValueError("the CURVE client secret key is not a 40-character Z85 key")
        if secret and not is_key(secret):
            raise ValueError("the CURVE secret key is not a 40-character Z85 key")
        if public and not is_key(public):
            raise ValueError("the CURVE public key is not a 40-character Z85 key")
        if secret:
            derived = zmq.curve_public(secret.encode()).decode()
            if public and public != derived:
                raise ValueError("the CURVE public key is not the public half of the secret key")
            public = derived
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE support")
        return cls(server_public=public, server_secret=secret, client_secret=client_secret, allowed_keys=allowed_keys)

    @classmethod
    def from_settings(cls, settings) -> Curve | None:
        """From Settings.curve_* (SWITCHYARD_CURVE_*); None when neither server key is set."""
        return cls.from_keys(
            settings.curve_secret_key,
            settings.curve_public_key,
            settings.curve_client_secret_key,
            settings.curve_allowed_keys,
        )

    def client_pair(self) -> tuple[bytes, bytes]:
        """(public, secret) this process presents as a CURVE client."""
        secret = self.client_secret or self.server_secret
        if secret:
            return zmq.curve_public(secret.encode()), secret.encode()
        return zmq.curve_keypair()


def curve_keypair() -> tuple[str, str]:
    """A new (public, secret) CURVE keypair, Z85 text (`switchyard keygen`)."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def secure(sock: zmq.Socket, curve: Curve, *, server: bool) -> None:
    """Turn CURVE on for `sock`; must come before bind/connect."""
    if server:
        if not curve.server_secret:
            raise ValueError(
                "a CURVE server socket needs the secret key (SWITCHYARD_CURVE_SECRET_KEY); this process has only "
                "the public one"
            )
        if curve.allowed_keys:  # the ZAP handler of this socket's context, before it binds
            bus_auth.require_listed_clients(sock.context, curve.allowed_keys, curve.server_public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret.encode())
        return
    public, secret = curve.client_pair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


_UNSET = object()
_curve: Curve | None | object = _UNSET  # this process's bus key: configure(), else the environment on first use
_plaintext_ok = False  # Settings.bus_insecure: a tcp socket without a key is allowed


def configure(settings) -> Curve | None:
    """Set this process's bus key from its Settings (service.run does, once); every tcp socket made by
    socket() afterwards uses it. Returns it (None: plaintext)."""
    global _curve, _plaintext_ok
    _curve, _plaintext_ok = Curve.from_settings(settings), settings.bus_insecure
    return _curve


def configured() -> Curve | None:
    """This process's bus key; a process that never called configure() (http) takes it from Settings.from_env()."""
    if _curve is _UNSET:
        configure(Settings.from_env())
    return _curve  # type: ignore[return-value]


class PlaintextRefused(RuntimeError):
    """A tcp bus socket without a key, in a process not told that a plaintext bus is meant (bus_insecure)."""


def socket(
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    ctx: zmq.Context | None = None,
    curve: Curve | None | object = _UNSET,
):
    """A socket with the bus's options; `ctx` may be a zmq.asyncio.Context (http).

    CURVE: by default the process's key (configure()) on a tcp:// address and nothing on ipc://; a
    binder is the CURVE server, a connector its client. `curve=` overrides that (None: plaintext)."""
    if curve is _UNSET:
        tcp = (bind or connect or "").startswith("tcp://")
        curve = configured() if tcp else None
        if tcp and curve is None and not _plaintext_ok:
            raise PlaintextRefused(
                "the bus is tcp without a key: anyone who reaches its ports could read and inject. Give it one "
                "(switchyard keygen; SWITCHYARD_CURVE_SECRET_KEY) or run it in the clear on purpose "
                "(--bus-insecure, SWITCHYARD_BUS_INSECURE=1)"
            )
    sock = (ctx or context()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    try:
        if curve is not None:
            secure(sock, curve, server=bool(bind))  # type: ignore[arg-type]
        if bind:
            sock.bind(bind)
        if connect:
            sock.connect(connect)
    except Exception:
        sock.close()
        raise
    return sock


def send(sock: zmq.Socket, msg: Message) -> None:
    sock.send_multipart(codec.encode(msg), copy=False)


def recv(sock: zmq.Socket) -> Message | None:
    """The next message, or None (logged) if the frames were malformed."""
    frames = sock.recv_multipart(copy=False)
    try:
        return codec.decode([f.buffer for f in frames])
    except ProtocolError as e:
        log.warning("dropped malformed message: %s", e)
        return None


_buses: list[EventBus] = []  # this process's event buses, for the leaving heartbeat


def say_goodbye() -> None:
    """A clean stop (SIGTERM): one last heartbeat with leaving=True, so peers drop us at once (docs/recovery.md)."""
    for eb in _buses:
        try:
            eb.pub.send_multipart(
                codec.encode_pub(eb.hb_topic, eb.heartbeat_message(leaving=True)),
                copy=False,
                flags=zmq.NOBLOCK,
            )
        except zmq.ZMQError:
            pass
    if _buses:
        time.sleep(0.1)  # the I/O thread sends it; the context is then destroyed without linger


HELLO_EVERY = 0.1  # seconds between two Hellos while a bus starts
# a run that hears another live run of its own role and index within this long of its first heartbeat is the
# newcomer and exits with EXIT_CLAIMED (the holder beats every HEARTBEAT_S, so it is heard well within it)
CLAIM_YOUNG_S = 3 * HEARTBEAT_S
EXIT_CLAIMED = 3


class BusEnds:
    """What the synchronous EventBus and its asyncio twin (libs.runtime.async_bus) share: the PUB and SUB on
    the router's event proxy, how an event is decoded, what proves the bus live, and what a heartbeat says."""

    def __init__(self, addresses: Addresses, role: str, index: int, subscribe: list[bytes], ctx=None):
        self.role, self.index = role, index
        self.hb_topic = topics.hb(role, index)
        self.instance = secrets.token_hex(8)  # this run of the process (Heartbeat.instance)
        self._first_beat: float | None = None  # when this run first published a heartbeat
        self.pub = socket(zmq.PUB, connect=addresses.events_in, ctx=ctx)
        self.sub = socket(zmq.SUB, connect=addresses.events_out, ctx=ctx)
        for topic in [*subscribe, self.hb_topic]:
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._next_hb = 0.0
        self._metrics_pacing = MetricsPacing()

    def decode(self, frames) -> tuple[bytes, Message] | None:
        """(topic, message) of an event's frames, or None (logged) if they were malformed. A heartbeat of another
        run claiming this process's role and index, heard while this run is young, ends this run (`claimed`)."""
        try:
            got = codec.decode_pub([f.buffer for f in frames])
        except ProtocolError as e:
            log.warning("dropped malformed event: %s", e)
            return None
        if isinstance(got[1], Heartbeat) and self.claimed(got[1]):
            log.critical(
                "%s %d is already running (pid %d, run %s): refusing to run a second one. Give this process "
                "another index (SWITCHYARD_INDEX), or stop the other",
                self.role,
                self.index,
                got[1].pid,
                got[1].instance,
            )
            logging.shutdown()
            os._exit(EXIT_CLAIMED)
        return got

    def claimed(self, hb: Heartbeat) -> bool:
        """Is `hb` another live run of this process's role and index, heard while this run is the newcomer (it has
        beaten for less than CLAIM_YOUNG_S)? The older run heard this one too, and stays."""
        other = (hb.role, hb.index) == (self.role, self.index) and hb.instance and hb.instance != self.instance
        young = self._first_beat is None or time.monotonic() - self._first_beat < CLAIM_YOUNG_S
        return bool(other and not hb.leaving and young)

    def heartbeat_message(self, **load) -> Heartbeat:
        return Heartbeat(role=self.role, index=self.index, pid=os.getpid(), instance=self.instance, **load)

    @staticmethod
    def hello() -> Hello:
        """A Hello with a fresh nonce: once it comes back through the proxy, both the publish path and our
        subscriptions are live (`echoes`)."""
        return Hello(nonce=secrets.token_hex(8))

    @staticmethod
    def echoes(got: tuple[bytes, Message] | None, hello: Hello) -> bool:
        return got is not None and isinstance(got[1], Hello) and got[1].nonce == hello.nonce

    def heartbeat_due(self) -> bool:
        """Whether `heartbeat` would publish now: a caller whose load is costly to gather asks first."""
        return time.monotonic() >= self._next_hb

    def heartbeat_in(self) -> float:
        """Seconds until the next heartbeat is due (for a loop that only beats: sleep that long)."""
        return max(0.0, self._next_hb - time.monotonic())

    def _beat(self, load: dict) -> Heartbeat | None:
        """The heartbeat to publish now, or None if none is due (one every HEARTBEAT_S).

        It carries this process's metrics text (`metrics.exposition()`) when one is due by its pacing
        (libs/runtime/metrics_pacing.py): a heartbeat without it (metrics="") means "unchanged since my last
        one" to the aggregator."""
        now = time.monotonic()
        if now < self._next_hb:
            return None
        self._next_hb = now + HEARTBEAT_S
        if "metrics" not in load and self._metrics_pacing.due(now):
            cpu = time.thread_time()
            load["metrics"] = metrics.heartbeat_exposition()
            self._metrics_pacing.rendered(now, time.thread_time() - cpu)
        if self._first_beat is None:
            self._first_beat = now
        return self.heartbeat_message(**load)


class EventBus(BusEnds):
    """One process's PUB and SUB on the router's event proxy, plus its heartbeat (synchronous services)."""

    def __init__(self, addresses: Addresses, role: str, index: int, subscribe: list[bytes]):
        super().__init__(addresses, role, index, subscribe)
        _buses.append(self)

    def publish(self, topic: bytes, msg: Message) -> None:
        self.pub.send_multipart(codec.encode_pub(topic, msg), copy=False)

    def recv(self) -> tuple[bytes, Message] | None:
        return self.decode(self.sub.recv_multipart(copy=False))

    def start(self, timeout: float = 60.0) -> None:
        """Block until our own Hello comes back through the proxy."""
        hello, deadline = self.hello(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.publish(self.hb_topic, hello)
            if self.sub.poll(HELLO_EVERY * 1000) and self.echoes(self.recv(), hello):
                return
        raise TimeoutError("event bus did not echo our hello: is the router running?")

    def heartbeat(self, **load) -> None:
        """Publish a heartbeat if one is due (see `_beat`); call it from the main loop."""
        hb = self._beat(load)
        if hb is not None:
            self.publish(self.hb_topic, hb)


def exit_on_sigterm() -> None:
    """Turn SIGTERM (supervisord's stop) into KeyboardInterrupt so `finally` blocks run."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
