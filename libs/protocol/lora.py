"""Bus messages that load and unload LoRA adapters while serving (docs/lora.md, "Hot load / unload").

http → every scheduler (`ctl.<replica>`): `LoadAdapter` / `UnloadAdapter`, each with an `op_id` http waits on.
scheduler → its shards (plan PUB, between two steps, so every tensor-parallel rank changes at the same point):
`ShardAdapters`, the whole run-time set, which a shard diffs against what it holds (so a restarted shard gets
the same message and reloads everything). Every rank answers `ShardAdaptersAck` on the results PULL.
scheduler → http (`out.<ingress>`): `AdapterDone`, once all its ranks answered.
scheduler → http and tokenizers (`lora.<replica>`): `AdapterSet`, the names requests may use, on every change
and with each heartbeat (a restarted http or tokenizer learns the current set within a second).
"""

from __future__ import annotations

import time

from libs.protocol.message_base import Message


class LoadAdapter(Message, tag="load_adapter", kw_only=True):
    op_id: str  # chosen by http; AdapterDone names it
    ingress: int  # http process waiting for the answer
    name: str
    path: str  # a local folder with adapter_config.json and adapter_model.safetensors


class UnloadAdapter(Message, tag="unload_adapter", kw_only=True):
    op_id: str
    ingress: int
    name: str


class AdapterDone(Message, tag="adapter_done", kw_only=True):
    op_id: str
    replica: int
    error: str | None = None  # why the replica refused (None: done)
    status: int = 200  # the HTTP status the refusal maps to (vLLM's: 400 bad request, 404 unknown name)


class ShardAdapters(Message, tag="shard_adapters", kw_only=True):
    op: int  # the scheduler's counter; the ack repeats it
    adapters: dict[str, str] = {}  # name → folder: every adapter the shard must hold after this message
    # name → load generation: an adapter reloaded under a name it had before is a new adapter
    generations: dict[str, int] = {}


class ShardAdaptersAck(Message, tag="shard_adapters_ack", kw_only=True):
    op: int
    rank: int
    errors: dict[str, str] = {}  # name → why this rank could not load it (it holds the rest)
    loaded: list[str] = []


class AdapterSet(Message, tag="adapter_set", kw_only=True):
    replica: int
    names: list[str] = []  # the adapters a new request may name on this replica


ANY_LORA_MESSAGE = LoadAdapter | UnloadAdapter | AdapterDone | ShardAdapters | ShardAdaptersAck | AdapterSet


class KnownAdapters:
    """The adapter names a new request may use, as http and the tokenizers learn them from `AdapterSet`s.

    A name counts once every replica that announced a set holds it: a load answers only after all replicas
    loaded it, and an unload takes the name off a replica's set at once (new requests are refused while the
    running ones finish). Before any announcement, the start-up list from the settings stands. A replica announces
    its set with every heartbeat: one not renewed for `fresh_s` is a gone replica's and no longer counts (while
    some replica's is renewed)."""

    def __init__(self, fresh_s: float = 3.0) -> None:
        self.by_replica: dict[int, list[str]] = {}
        self.heard: dict[int, float] = {}  # replica → when its set was last announced (monotonic)
        self.fresh_s = fresh_s

    def update(self, msg: AdapterSet) -> None:
        self.by_replica[msg.replica] = list(msg.names)
        self.heard[msg.replica] = time.monotonic()

    def names(self, start: list[str]) -> list[str]:
        if not self.by_replica:
            return list(start)
        now = time.monotonic()
        live = [names for r, names in self.by_replica.items() if now - self.heard.get(r, now) < self.fresh_s]
        first, *rest = live or list(self.by_replica.values())
        return [name for name in first if all(name in names for names in rest)]
