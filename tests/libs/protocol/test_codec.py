"""Every message round-trips through the codec; malformed frames raise ProtocolError, never crash."""

import random

import msgspec
import numpy as np
import pytest

from libs.protocol import ProtocolError, codec, topics
from libs.protocol.addresses import Addresses
from libs.protocol.messages import (
    FINISH_EOS,
    Abort,
    Accepted,
    ChatFormatNote,
    FinalInfo,
    GenerateRequest,
    Heartbeat,
    Hello,
    ImageInput,
    RequestError,
    Resync,
    StopHit,
    StreamOpen,
    TextBatch,
    TextRow,
    TokenBatch,
    TokenizedRequest,
    TokenizeResult,
    TokenText,
    Unknown,
)
from libs.protocol.params import Parameters, SamplingParams
from libs.protocol.step_messages import NewSequence, ShardReady, StepPlan, StepResult

SAMPLES = [
    GenerateRequest(
        request_id="a" * 32,
        ingress=3,
        inputs="héllo 🌍",
        parameters=Parameters(max_new_tokens=5, do_sample=True, temperature=0.7, top_k=4, stop=["\n"], seed=2**63),
        received_at=1.5,
    ),
    TokenizedRequest(
        request_id="b" * 32,
        ingress=0,
        input_ids=np.array([1, 2, 3, 70000], np.int32),
        sampling=SamplingParams(do_sample=True, temperature=0.5, top_k=3, top_p=0.9, seed=2**64 - 1),
        max_new_tokens=7,
        stop=["x", "yz"],
        seed=2**64 - 1,
        replica=1,
        detokenizer=2,
    ),
    StepPlan(
        step=9,
        new=[NewSequence(4, SamplingParams())],
        blocks={4: [7, 3, 9]},
        finished=[1, 2],
        seqs=np.array([4, 5], np.int32),
        num_tokens=np.array([3, 1], np.int32),
        context_lens=np.array([0, 40], np.int32),
        token_ids=np.array([5, 6, 7, 8], np.int32),
        sample=np.array([1, 1], np.uint8),
    ),
    StepPlan(step=0),
    StepResult(
        step=9,
        forward_s=0.01,
        seqs=np.array([4, 5], np.int32),
        token_ids=np.array([10, 11], np.int32),
        logprobs=np.array([-0.5, -1.25], np.float32),
    ),
    StepResult(step=3, error="RuntimeError: boom"),
    StepResult(
        step=10,
        seqs=np.array([4, 5], np.int32),
        token_ids=np.array([10, 11], np.int32),
        logprobs=np.array([-0.5, -1.25], np.float32),
        top_counts=np.array([2, 0], np.int32),
        top_ids=np.array([10, 3], np.int32),
        top_logprobs=np.array([-0.5, -2.0], np.float32),
        prompt_seqs=np.array([4], np.int32),
        prompt_counts=np.array([3], np.int32),
        prompt_logprobs=np.array([np.nan, -1.0, -2.0], np.float32),
    ),
    GenerateRequest(
        request_id="9" * 32,
        ingress=0,
        inputs="",
        parameters=Parameters(best_of=2, top_n_tokens=3, grammar={"type": "regex", "value": "a+"}),
        mode="tokenize",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ),
    TokenizeResult(
        request_id="8" * 32,
        text="a b",
        ids=np.array([5, 6], np.int32),
        starts=np.array([0, 1], np.uint32),
        stops=np.array([1, 3], np.uint32),
    ),
    ShardReady(rank=0, pid=123, num_blocks=4096),
    Hello(nonce="ab12"),
    Accepted(request_id="c" * 32, replica=0, input_length=12),
    RequestError(
        request_id="c" * 32, message="Input validation error: `inputs` cannot be empty", error_type="validation"
    ),
    TokenBatch(
        replica=0,
        request_ids=["d" * 32, "e" * 32],
        opens=[StreamOpen(request_id="d" * 32, ingress=1, replica=0, input_length=5, prompt_tail=[1, 2], stop=["a"])],
        offsets=np.array([0, 17], np.uint32),
        token_ids=np.array([42, 2], np.int32),
        logprobs=np.array([-0.1, -0.2], np.float32),
        finish=np.array([0, FINISH_EOS], np.uint8),
    ),
    TextBatch(
        rows=[
            TextRow(request_id="d" * 32, index=1, token_id=42, text=" hi", logprob=-0.1, special=False),
            TextRow(
                request_id="e" * 32,
                index=18,
                token_id=2,
                text="</s>",
                logprob=-0.2,
                special=True,
                final=FinalInfo(generated_text="…", finish_reason="eos_token", generated_tokens=18, input_length=5),
            ),
            TextRow(
                request_id="g" * 32,
                index=1,
                token_id=5,
                text="a",
                logprob=-0.3,
                special=False,
                top_tokens=[TokenText(id=5, text="a", logprob=-0.3), TokenText(id=6, text="b", logprob=-1.5)],
                final=FinalInfo(
                    generated_text="a",
                    finish_reason="length",
                    generated_tokens=1,
                    input_length=2,
                    prefill=[
                        TokenText(id=1, text="<s>", logprob=None, special=True),
                        TokenText(id=9, text="x", logprob=-4),
                    ],
                ),
            ),
        ]
    ),
    Abort(request_id="f" * 32),
    StopHit(request_id="f" * 32, generated_tokens=4),
    Resync(request_id="f" * 32, ingress=1),
    Unknown(request_id="f" * 32),
    Heartbeat(
        role="scheduler", index=0, pid=1, queue=2, running=3, free_blocks=4, total_blocks=5, counters={"steps": 9}
    ),
    Heartbeat(
        role="tokenizer",
        index=1,
        pid=1,
        model="m",
        chat_format=ChatFormatNote(
            templates={"default": "{{ messages }}"}, eos_token="</s>", tool_call_parser="hermes"
        ),
    ),
]


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            # a missing array is sent as an empty one
            if not np.array_equal(
                np.asarray([] if x is None else x, float), np.asarray([] if y is None else y, float), equal_nan=True
            ):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = codec.encode(msg)
    assert len(frames) == 1 + len(msg.FRAMES)
    back = codec.decode([bytes(f) for f in frames])
    assert same(msg, back)
    topic, again = codec.decode_pub(codec.encode_pub(topics.out(7), msg))
    assert topic == b"out.0007" and same(msg, again)


def test_every_message_kind_is_sampled():
    """Every kind of `messages` and `step_messages` (LoRA's: tests/libs/protocol/test_lora.py)."""
    from libs.protocol import message_base, messages, step_messages

    kinds = {
        c
        for module in (messages, step_messages)
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, message_base.Message) and c.__module__ == module.__name__
    }
    assert kinds == {type(m) for m in SAMPLES}


def test_arrays_travel_as_raw_frames_not_msgpack():
    msg = SAMPLES[1]
    body, ids, pixels, pixel_bytes = codec.encode(msg)
    assert bytes(ids) == np.array([1, 2, 3, 70000], "<i4").tobytes()
    assert bytes(pixels) == bytes(pixel_bytes) == b""  # a text-only request: no images' pixels
    assert msgspec.msgpack.decode(body)["input_ids"] is None


def test_image_size_is_optional_both_ways():
    """A peer without ImageInput's trailing image_size reads a message that has it, and one that has it reads a
    message without it (an empty size)."""

    class Older(msgspec.Struct, kw_only=True, array_like=True):
        digest: str
        start: int
        tokens: int
        shape: list[int]

    sized = ImageInput(digest="d", start=1, tokens=2, shape=[5, 3, 4, 4], image_size=[30, 40])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sized), type=Older).shape == [5, 3, 4, 4]
    older = msgspec.msgpack.encode(Older(digest="d", start=1, tokens=2, shape=[3]))
    assert msgspec.msgpack.decode(older, type=ImageInput).image_size == []
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sized), type=ImageInput) == sized


BAD = [
    [],  # no frames
    [b"\xc1"],  # not msgpack
    [b"\x93\x01\x02\x03"],  # msgpack, not a message
    [msgspec.msgpack.encode({"kind": "nope", "v": 1})],  # unknown kind
    [msgspec.msgpack.encode({"kind": "abort", "v": 1})],  # missing field
    [msgspec.msgpack.encode({"kind": "abort", "v": 1, "request_id": 5})],  # wrong type
    [msgspec.msgpack.encode({"kind": "abort", "v": 99, "request_id": "x"})],  # other version
    codec.encode(SAMPLES[1])[:1],  # array frame missing
    [*codec.encode(SAMPLES[1]), b"extra"],  # one frame too many
    [codec.encode(SAMPLES[1])[0], b"\x01\x02\x03"],  # not a whole int32
    [codec.encode(SAMPLES[1])[0], b""],  # no input ids
    [bytes(f) for f in codec.encode(SAMPLES[2])][:-1] + [b"\x01"],  # plan: rows of unequal length
]


@pytest.mark.parametrize("frames", BAD)
def test_malformed_is_rejected(frames):
    with pytest.raises(ProtocolError):
        codec.decode(frames)


def test_mutated_frames_never_crash():
    rng = random.Random(0)
    for msg in SAMPLES:
        frames = [bytearray(bytes(f)) for f in codec.encode(msg)]
        for _ in range(200):
            mutated = [bytearray(f) for f in frames]
            f = rng.choice(mutated)
            if f:
                for _ in range(rng.randint(1, 4)):
                    f[rng.randrange(len(f))] = rng.randrange(256)
            if rng.random() < 0.2:
                del mutated[rng.randrange(len(mutated))]
            try:
                codec.decode([bytes(m) for m in mutated])
            except ProtocolError:
                pass


def test_topics_are_fixed_width():
    assert topics.out(1) == b"out.0001" and not topics.out(10).startswith(topics.out(1))
    assert topics.hb("tokenizer", 2) == b"hb.tokenizer.0002"
    with pytest.raises(ValueError):
        topics.tok(10_000)


def test_addresses():
    ipc = Addresses.parse("ipc:///tmp/sy-abc")
    assert ipc.intake == "ipc:///tmp/sy-abc/intake"
    assert ipc.replica(1, "plan") == "ipc:///tmp/sy-abc/replica-1-plan"
    tcp = Addresses.parse("tcp://127.0.0.1:5550")
    assert (tcp.intake, tcp.events_out) == ("tcp://127.0.0.1:5550", "tcp://127.0.0.1:5554")
    assert tcp.replica(1, "results") == "tcp://127.0.0.1:5565"
    assert Addresses.parse("tcp://[::1]:7000").admit == "tcp://[::1]:7002"
    for bad in ["udp://x", "ipc://relative", "tcp://host", "ipc:///" + "x" * 100]:
        with pytest.raises(ValueError):
            Addresses.parse(bad)
