"""`switchyard tap` (also `python -m launcher.tap`): watch a running server's event bus, live.

It is one more SUB on the router's event proxy, so attaching and detaching never disturb the server (a PUB drops
messages for a slow or gone subscriber). Per row it prints token batches (tok.*: request id, offset, token id,
logprob, finish reason), text batches (out.*: request id, index, text, and the final info on the last row), and
one summary line for anything else on the chosen topics. It confirms its subscription before it prints
"attached" (its own hello comes back through the proxy on a topic only it hears), so it sees every event after
that line. On a CURVE bus it needs the deployment's public key (--curve-public-key, a file holding it, or
SWITCHYARD_CURVE_PUBLIC_KEY; the public half of SWITCHYARD_CURVE_SECRET_KEY also serves). docs/observability.md
has examples.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import zmq

from launcher import bus_flags, rundir
from libs.protocol import Addresses, ProtocolError, codec
from libs.protocol.messages import FINISH_NAMES, FINISH_NONE, Heartbeat, Hello, TextBatch, TokenBatch
from libs.runtime import bus

DEFAULT_TOPICS = ("tok.", "out.")
TAP_TOPIC = b"tap."  # nothing in the server subscribes to it: our hello disturbs no one


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bus", help="ipc:///run/dir or tcp://host:port (default: the one live local server's)")
    p.add_argument(
        "--curve-public-key",
        default=bus_flags.env_default("--curve-public-key", "curve_public_key"),
        metavar="KEY|FILE",
        help=f"the bus's CURVE public key, or a file holding it (env CURVE_PUBLIC_KEY or {bus_flags.PUBLIC_VAR}), "
        "for an encrypted bus",
    )
    p.add_argument(
        "--curve-client-key",
        default=bus_flags.env_default("--curve-client-key", "curve_client_secret_key"),
        metavar="KEY|FILE",
        help=f"the tap's client secret key, or a file holding it (switchyard keygen --client; env CURVE_CLIENT_KEY "
        f"or {bus_flags.CLIENT_SECRET_VAR}), for a bus that lets in only listed clients",
    )
    p.add_argument("--request", help="only this request id")
    p.add_argument(
        "--topic", action="append", help="only topics starting with this prefix (tok., out., hb., ctl.); repeatable"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per event row")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the subscription (default 10)")


def find_bus(where: Path | None = None) -> str:
    """The bus of the only live server of this user: its run directory under the run root (/tmp, or
    $SWITCHYARD_RUN_ROOT). A directory left by a server that died is not one: its lock is free."""
    base = where or rundir.root()
    found = [d for d in rundir.live(base) if (d / "events-out").exists()]  # a tcp bus leaves no socket here
    if len(found) == 1:
        return f"ipc://{found[0]}"
    if not found:
        raise SystemExit(f"error: no running Switchyard found (no live {base}/switchyard-*); give --bus")
    listing = "\n  ".join(f"ipc://{d}" for d in found)
    raise SystemExit(f"error: several Switchyard servers are running; pick one with --bus:\n  {listing}")


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 6)


def rows(topic: bytes, msg, request: str | None = None) -> list[dict]:
    """The printable rows of one event, as dicts (filtered by request id when given)."""
    t = topic.decode(errors="replace")
    out = []
    if isinstance(msg, TokenBatch):
        cols = zip(msg.request_ids, msg.offsets.tolist(), msg.token_ids.tolist(), msg.logprobs.tolist())
        for (rid, offset, token, logprob), finish in zip(cols, msg.finish.tolist()):
            if request is None or rid == request:
                reason = None if finish == FINISH_NONE else FINISH_NAMES.get(finish, "error")
                out.append(
                    {
                        "topic": t,
                        "event": "token",
                        "request_id": rid,
                        "offset": offset,
                        "token_id": token,
                        "logprob": _num(logprob),
                        "finish": reason,
                    }
                )
    elif isinstance(msg, TextBatch):
        for r in msg.rows:
            if request is None or r.request_id == request:
                row = {"topic": t, "event": "text", "request_id": r.request_id, "index": r.index}
                row |= {"token_id": r.token_id, "text": r.text}
                if r.final is not None:
                    row["final"] = {
                        "finish_reason": r.final.finish_reason,
                        "generated_tokens": r.final.generated_tokens,
                        "generated_text": r.final.generated_text,
                    }
                out.append(row)
    elif isinstance(msg, Heartbeat):
        if request is None:
            keep = ("role", "index", "pid", "ready", "queue", "running", "free_blocks", "total_blocks", "counters")
            out.append({"topic": t, "event": "hb", **{k: getattr(msg, k) for k in keep}})
    elif not isinstance(msg, Hello):
        rid = getattr(msg, "request_id", None)
        if request is None or rid == request:
            body = {f: getattr(msg, f) for f in msg.__struct_fields__ if f not in ("v",) and f not in dict(msg.FRAMES)}
            out.append({"topic": t, "event": type(msg).__name__, **body})
    return out


def render(row: dict) -> str:
    """One human-readable line for a row (control characters in texts shown escaped)."""
    head = f"{row['topic']} {row.get('request_id', '-')}"
    ev = row["event"]
    if ev == "token":
        fin = f" finish={row['finish']}" if row["finish"] else ""
        return f"{head} offset={row['offset']} token={row['token_id']} logprob={row['logprob']}{fin}"
    if ev == "text":
        line = f"{head} index={row['index']} token={row['token_id']} text={json.dumps(row['text'], ensure_ascii=False)}"
        if "final" in row:
            f = row["final"]
            line += f" final={f['finish_reason']} tokens={f['generated_tokens']}"
        return line
    rest = {k: v for k, v in row.items() if k not in ("topic", "event", "request_id")}
    return f"{head} {ev} {json.dumps(rest, ensure_ascii=False, default=str)}"


def curve_from(public_arg: str | None, client_arg: str | None = None) -> bus.Curve | None:
    """The key to join an encrypted bus with: --curve-public-key, else the public half of the secret in
    the environment, else None (plaintext); and the client key to present (--curve-client-key, else fresh)."""
    public = bus_flags.read_key(public_arg, bus_flags.PUBLIC_VAR, "--curve-public-key")
    secret = "" if public else bus_flags.env_default("--bus-curve-secret-key", "curve_secret_key") or ""
    client = bus_flags.read_key(client_arg, bus_flags.CLIENT_SECRET_VAR, "--curve-client-key")
    try:
        curve = bus.Curve.from_keys(secret, public, client_secret=client)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None
    if curve is None:
        return None
    return bus.Curve(server_public=curve.server_public, client_secret=client)  # a client needs no server secret


def attach(
    bus_spec: str, prefixes: list[bytes], timeout: float, curve: bus.Curve | None = None
) -> tuple[zmq.Socket, zmq.Socket]:
    """A SUB on the events-out of `bus_spec` with its subscriptions confirmed, and the PUB used to
    confirm them (kept open: closing a socket is what detaching is). `curve`: the bus's key, on tcp."""
    addresses = Addresses.parse(bus_spec)
    curve = curve if bus_spec.startswith("tcp://") else None
    sub = bus.socket(zmq.SUB, connect=addresses.events_out, curve=curve)
    nonce = secrets.token_hex(8)
    hello_topic = TAP_TOPIC + nonce.encode()
    for p in [*prefixes, hello_topic]:
        sub.setsockopt(zmq.SUBSCRIBE, p)
    pub = bus.socket(zmq.PUB, connect=addresses.events_in, curve=curve)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub.send_multipart(codec.encode_pub(hello_topic, Hello(nonce=nonce)))
        while sub.poll(100):
            if sub.recv_multipart()[0] == hello_topic:
                return sub, pub
            # events before our hello are dropped: only what follows "attached" is promised
    sub.close()
    pub.close()
    hint = "" if not bus_spec.startswith("tcp://") else " (or is its bus encrypted? give --curve-public-key)"
    if curve is not None:
        hint = " (or does its bus let in only listed clients? give --curve-client-key, a listed one)"
    raise SystemExit(
        f"error: no answer from the event bus at {bus_spec} within {timeout:g}s: is the server running?{hint}"
    )


def run(args: argparse.Namespace) -> int:
    bus_spec = bus_flags.bus_address(args.bus, "--bus") if args.bus and not args.bus.startswith("ipc://") else args.bus
    bus_spec = bus_spec or find_bus()
    prefixes = [p.encode() for p in (args.topic or DEFAULT_TOPICS)]
    sub, pub = attach(bus_spec, prefixes, args.timeout, curve_from(args.curve_public_key, args.curve_client_key))
    out = sys.stdout
    # Ctrl-C and a kill detach cleanly, also when our parent started us with SIGINT ignored or blocked (both are
    # inherited across exec, and Python then installs no handler: seen when started from a long test session)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        print(f"# attached to {bus_spec} (topics: {', '.join(p.decode() for p in prefixes)})", file=sys.stderr)
        while True:
            frames = sub.recv_multipart(copy=False)
            topic = bytes(frames[0])
            if topic.startswith(TAP_TOPIC):
                continue
            try:
                _, msg = codec.decode_pub([f.buffer for f in frames])
            except ProtocolError as e:
                print(f"# malformed event on {topic!r}: {e}", file=sys.stderr)
                continue
            for row in rows(topic, msg, args.request):
                out.write((json.dumps(row, ensure_ascii=False, default=str) if args.json else render(row)) + "\n")
            out.flush()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `switchyard tap | head`: the reader left; silence the final flush too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        sub.close()
        pub.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="switchyard tap", description="Print a running server's token and text events.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
