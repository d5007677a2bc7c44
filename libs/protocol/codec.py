"""Frames on the wire: `[topic]` (PUB only), `[msgpack body]`, `[raw array]…`.

The body is a tagged msgspec Struct from `messages`, `step_messages` or `lora`; the fields a message lists in
`FRAMES` travel as raw little-endian arrays after it, so token ids never become msgpack lists. Decoding checks
the version, the frame count, array sizes and the message's own invariants, and raises
`ProtocolError` on anything malformed: a receiver logs and drops it, it never crashes.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from libs.protocol.lora import ANY_LORA_MESSAGE
from libs.protocol.message_base import WIRE_VERSION, Message
from libs.protocol.messages import ANY_MESSAGE
from libs.protocol.step_messages import ANY_STEP_MESSAGE

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ANY_MESSAGE | ANY_STEP_MESSAGE | ANY_LORA_MESSAGE)  # every kind on the bus


class ProtocolError(ValueError):
    """A frame that is not a valid Switchyard message."""


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frames of one message: the msgpack body, then one raw buffer per FRAMES field.

    Raises ProtocolError for a value msgpack cannot carry (an int beyond 64 bits in a client's chat
    message or tool, say): the sender refuses that request instead of failing on it."""
    try:
        return _encode(msg)
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        raise ProtocolError(f"{type(msg).__name__} cannot be encoded: {e}") from None


def _encode(msg: Message) -> list[bytes | memoryview]:
    if not msg.FRAMES:
        return [_encoder.encode(msg)]
    arrays = []
    for name, dtype in msg.FRAMES:
        value = getattr(msg, name)
        arrays.append(np.ascontiguousarray([] if value is None else value, dtype=dtype))
    body = msgspec.structs.replace(msg, **{name: None for name, _ in msg.FRAMES})
    return [_encoder.encode(body), *(memoryview(a).cast("B") for a in arrays)]


def decode(frames: Sequence[bytes | memoryview]) -> Message:
    """The message in `frames` (body + raw arrays); raises ProtocolError if malformed."""
    if not frames:
        raise ProtocolError("no frames")
    try:
        msg = _decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"bad message body: {e}") from None
    except RecursionError:  # deeply nested msgpack in an `Any` field (e.g. grammar): msgspec recurses in C
        raise ProtocolError("bad message body: nested too deeply") from None
    if msg.v != WIRE_VERSION:
        raise ProtocolError(
            f"wire version {msg.v}, expected {WIRE_VERSION}: a process of another Switchyard release (every process "
            "of a server must run the same one)"
        )
    if len(frames) - 1 != len(msg.FRAMES):
        raise ProtocolError(f"{type(msg).__name__} needs {len(msg.FRAMES)} array frames, got {len(frames) - 1}")
    for (name, dtype), raw in zip(msg.FRAMES, frames[1:]):
        dt = np.dtype(dtype)
        if len(raw) % dt.itemsize:
            raise ProtocolError(f"{name}: {len(raw)} bytes is not a whole number of {dtype}")
        setattr(msg, name, np.frombuffer(raw, dtype=dt))
    check = getattr(msg, "check", None)
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise ProtocolError(f"{type(msg).__name__}: {e}") from None
    return msg


def encode_pub(topic: bytes, msg: Message) -> list[bytes | memoryview]:
    """Frames for the event bus: the topic first."""
    return [topic, *encode(msg)]


def decode_pub(frames: Sequence[bytes | memoryview]) -> tuple[bytes, Message]:
    """(topic, message) from event-bus frames; raises ProtocolError if malformed."""
    if len(frames) < 2:
        raise ProtocolError("event without a topic and a body")
    return bytes(frames[0]), decode(frames[1:])
