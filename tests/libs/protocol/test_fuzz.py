"""The bus codec under random and mutated frames (hypothesis): `decode` either returns a message or raises
ProtocolError, never anything else, so a receiver that logs and drops ProtocolError cannot be crashed by a
frame. Whatever decodes also encodes again (a receiver may forward it)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.protocol import ProtocolError, codec
from libs.protocol.message_base import Message
from tests.libs.protocol.test_codec import SAMPLES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_packer = msgspec.msgpack.Encoder()


def survives(frames) -> Message | None:
    """decode(frames); only ProtocolError may come out, and a decoded message must encode again."""
    try:
        msg = codec.decode(frames)
    except ProtocolError:
        return None
    assert isinstance(msg, Message)
    codec.encode(msg)
    return msg


def survives_pub(frames) -> None:
    try:
        topic, msg = codec.decode_pub(frames)
    except ProtocolError:
        return
    assert isinstance(topic, bytes) and isinstance(msg, Message)


# msgpack-able values of every shape, hostile ones included: huge and negative ints, NaN/inf, bytes where
# text is expected, nesting
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-(2**63), 2**64 - 1), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_random_frames(frames):
    survives(frames)
    survives_pub(frames)


@FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_byte_mutations_of_valid_frames(msg, data):
    frames = [bytes(f) for f in codec.encode(msg)]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frames) - 1))
        frame = bytearray(frames[i])
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "drop_frame", "dup_frame", "empty"]))
        if op == "flip" and frame:
            j = data.draw(st.integers(0, len(frame) - 1))
            frame[j] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            frame = frame[: data.draw(st.integers(0, len(frame)))]
        elif op == "insert":
            j = data.draw(st.integers(0, len(frame)))
            frame[j:j] = data.draw(st.binary(min_size=1, max_size=9))
        elif op == "empty":
            frame = bytearray()
        if op == "drop_frame" and len(frames) > 1:
            del frames[i]
        elif op == "dup_frame":
            frames.insert(i, bytes(frame))
        else:
            frames[i] = bytes(frame)
    survives(frames)
    survives_pub([b"out.0000", *frames])


@FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_field_mutations_of_valid_bodies(msg, data):
    """Valid msgpack with a field set to a value of any type, removed, or added: the body decodes or is refused."""
    frames = [bytes(f) for f in codec.encode(msg)]
    body = msgspec.msgpack.decode(frames[0])
    for _ in range(data.draw(st.integers(1, 3))):
        keys = sorted(body)
        op = data.draw(st.sampled_from(["set", "delete", "add"]))
        if op == "add":
            body[data.draw(st.text(max_size=8))] = data.draw(values)
        elif op == "delete":
            body.pop(data.draw(st.sampled_from(keys)), None)
        else:
            body[data.draw(st.sampled_from(keys))] = data.draw(values)
    frames[0] = _packer.encode(body)
    survives(frames)


@FUZZ
@given(st.sampled_from(SAMPLES), st.sampled_from(SAMPLES), st.data())
def test_frames_of_one_message_under_another(a, b, data):
    """Array frames of the wrong length or of another message: refused by the size and invariant checks."""
    fa, fb = codec.encode(a), codec.encode(b)
    extra = [bytes(f) for f in fb[1:]] + [data.draw(st.binary(max_size=40)) for _ in range(2)]
    n = len(a.FRAMES)
    frames = [
        bytes(fa[0]),
        *data.draw(st.lists(st.sampled_from(extra), min_size=n, max_size=n) if extra else st.just([])),
    ]
    survives(frames)


@pytest.mark.parametrize("depth", [200, 10_000, 1_000_000])
def test_deeply_nested_body_is_refused(depth):
    """An `Any` field (grammar, chat messages) nested deeper than Python recurses: a ProtocolError, not a
    RecursionError that would take the receiving process down."""
    from libs.protocol.messages import GenerateRequest
    from libs.protocol.params import Parameters

    marker = 987654321
    body = _packer.encode(
        GenerateRequest(request_id="a" * 32, ingress=0, inputs="x", parameters=Parameters(grammar=marker))
    )
    nested = b"\x91" * depth + b"\xc0"  # [[[…[nil]…]]]
    frames = [body.replace(_packer.encode(marker), nested)]
    msg = survives(frames)
    assert msg is not None or depth > 200


def test_wrong_version_and_unknown_kind():
    body = msgspec.msgpack.decode(bytes(codec.encode(SAMPLES[0])[0]))
    with pytest.raises(ProtocolError, match="wire version"):
        codec.decode([_packer.encode({**body, "v": 999})])
    # a peer of the release before the pixel frames: its request is refused whole, never read with shifted frames
    with pytest.raises(ProtocolError, match=r"wire version 1, expected \d+: a process of another Switchyard release"):
        codec.decode([_packer.encode({**body, "v": 1})])
    with pytest.raises(ProtocolError):
        codec.decode([_packer.encode({**body, "kind": "pickle"})])


@FUZZ
@given(st.lists(st.dictionaries(st.text(max_size=8), values, max_size=3), max_size=3), values)
def test_encoding_client_values_fails_only_with_protocol_error(messages, grammar):
    """Chat messages, tools and grammars are carried as the client sent them: encode refuses what msgpack cannot
    hold (ints past 64 bits) with ProtocolError, and what it encodes decodes to the same values."""
    from libs.protocol.messages import GenerateRequest
    from libs.protocol.params import Parameters

    req = GenerateRequest(
        request_id="f" * 32, ingress=0, inputs="", parameters=Parameters(grammar=grammar), messages=messages
    )
    try:
        frames = codec.encode(req)
    except ProtocolError:
        return
    back = codec.decode(frames)
    assert msgspec.msgpack.encode(back) == msgspec.msgpack.encode(req)
