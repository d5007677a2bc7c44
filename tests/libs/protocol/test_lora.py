"""The hot load/unload messages (libs.protocol.lora) cross the codec like every other message, and the names
http and the tokenizers accept are those every announcing replica holds (the start-up list until one announces)."""

import pytest

from libs.protocol import codec, topics
from libs.protocol import lora as lora_module
from libs.protocol.lora import (
    AdapterDone,
    AdapterSet,
    KnownAdapters,
    LoadAdapter,
    ShardAdapters,
    ShardAdaptersAck,
    UnloadAdapter,
)

MESSAGES = [
    LoadAdapter(op_id="ab", ingress=2, name="x", path="/a/x"),
    UnloadAdapter(op_id="cd", ingress=0, name="x"),
    AdapterDone(op_id="ab", replica=1, error="LoRA adapter 'x': uses DoRA", status=400),
    ShardAdapters(op=4, adapters={"x": "/a/x", "y": "/a/y"}, generations={"x": 3}),
    ShardAdaptersAck(op=4, rank=1, errors={"y": "folder /a/y does not exist"}, loaded=["x"]),
    AdapterSet(replica=0, names=["x"]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg
    topic, back = codec.decode_pub(codec.encode_pub(topics.lora(3), msg))
    assert topic == b"lora.0003" and back == msg


def test_every_lora_kind_is_sampled():
    from libs.protocol import lora, message_base

    kinds = {c for c in vars(lora).values() if isinstance(c, type) and issubclass(c, message_base.Message)}
    assert kinds - {message_base.Message} == {type(m) for m in MESSAGES}


def test_known_adapters_are_those_every_replica_holds():
    known = KnownAdapters()
    assert known.names(["s"]) == ["s"]  # nobody announced yet: the start-up list
    known.update(AdapterSet(replica=0, names=["s", "new"]))
    assert known.names(["s"]) == ["s", "new"]
    known.update(AdapterSet(replica=1, names=["s"]))  # replica 1 has not loaded it (yet)
    assert known.names(["s"]) == ["s"]
    known.update(AdapterSet(replica=1, names=["s", "new"]))
    known.update(AdapterSet(replica=0, names=["new"]))  # "s" being unloaded on replica 0: refused at once
    assert known.names(["s"]) == ["new"]


def test_a_replica_that_stopped_announcing_no_longer_counts(monkeypatch):
    known = KnownAdapters(fresh_s=3.0)
    now = [100.0]
    monkeypatch.setattr(lora_module.time, "monotonic", lambda: now[0])
    known.update(AdapterSet(replica=0, names=["s", "new"]))
    known.update(AdapterSet(replica=1, names=["s"]))  # a replica about to go away, without "new"
    assert known.names(["s"]) == ["s"]
    now[0] += 2.0
    known.update(AdapterSet(replica=0, names=["s", "new"]))  # replica 0 keeps announcing, replica 1 is silent
    now[0] += 1.5
    assert known.names(["s"]) == ["s", "new"]  # replica 1's set is 3.5 s old: a gone replica's
    now[0] += 10.0
    assert known.names(["s"]) == ["s"]  # every set stale: all of them stand, as nothing better is known
