"""LoRA adapters loaded and unloaded while serving, as one replica's scheduler runs them (docs/lora.md).

`LoraControl` owns the replica's run-time set (name → folder) and sends it whole (`ShardAdapters`) on the plan
stream, so every tensor-parallel rank changes between the same two steps and a restarted shard reloads it after
the probe. Changes run one at a time, each once every rank acked the last. A load is accepted only after every
rank loaded it (one rank's refusal undoes it: 400); an unload refuses new requests at once and reaches the shards
once no request of the replica uses the adapter. Each load's generation seeds the adapter's prefix-cache key, so
an earlier adapter of the same name never serves it. The served set is recorded in the run directory
(`lora-replica-<r>.json`, atomically), where a restarted scheduler takes it over. It holds no scheduler: the
batcher is asked whether an adapter is in use and told its key; bus traffic goes through two callables.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from libs.protocol import topics
from libs.protocol.lora import AdapterDone, AdapterSet, LoadAdapter, ShardAdapters, ShardAdaptersAck, UnloadAdapter
from libs.protocol.message_base import Message
from libs.protocol.messages import RequestError, TokenizedRequest
from libs.runtime import metrics

if TYPE_CHECKING:
    from services.scheduler.batcher import Batcher

log = logging.getLogger("switchyard.scheduler")


@dataclass
class _Op:
    op: int
    msg: LoadAdapter | UnloadAdapter
    acks: dict[int, dict[str, str]] = field(default_factory=dict)  # rank → its refusals


class LoraControl:
    def __init__(
        self,
        batcher: Batcher,  # asked `adapter_in_use`, told `key_adapter`
        *,
        replica: int,
        ranks: int,  # the replica's shards (Settings.num_shard): each must answer a change
        start: dict[str, str],  # the start-up adapters, name → folder (Settings.lora_adapters)
        model_id: str,  # no adapter may take the base model's name
        run_dir: str,  # where the served set is recorded (Settings.run_dir; "": nowhere)
        publish: Callable[[bytes, Message], None],  # on the event bus: (topic, message)
        to_shards: Callable[[Message], None],  # on the plan stream, to every rank
    ) -> None:
        self.batcher, self.replica, self.ranks, self.model_id = batcher, replica, max(1, ranks), model_id
        self.publish, self.to_shards = publish, to_shards
        self.wanted: dict[str, str] = dict(start)
        self.generations: dict[str, int] = {}  # start-up adapters have generation 0 (absent)
        self.queue: deque[LoadAdapter | UnloadAdapter] = deque()
        self.inflight: _Op | None = None
        self.ops = self.loads = 0
        self.state_path = Path(run_dir) / f"lora-replica-{replica}.json" if run_dir else None
        self.restored = self._restore()  # the names a restarted scheduler took over from its predecessor
        self.accepting: dict[str, None] = dict.fromkeys(self.wanted)  # ordered: start-up order, then loads
        m = metrics.get()
        if m is None:  # a scheduler built without service.run (tests): metrics of its own, unexported
            m = metrics.Metrics("scheduler", replica)
        self.requests, self.tokens, self.loaded = m.lora_requests, m.lora_generated_tokens, m.lora_adapters_loaded
        self.loaded.labels(replica=str(replica)).set(len(self.accepting))

    # ---- requests -------------------------------------------------------------------------
    def admits(self, req: TokenizedRequest, new: bool = True) -> bool:
        """False (and the request refused as the tokenizer would) when it names an adapter not served now: one
        being unloaded, whose refusal overtook the tokenizer's check. `new`: not a repeated delivery of a request
        the batcher holds (counted once)."""
        if req.adapter and req.adapter not in self.accepting:
            message = f"`adapter_id` `{req.adapter}` is not a loaded LoRA adapter"
            err = RequestError(request_id=req.request_id, message=message, error_type="validation")
            self.publish(topics.out(req.ingress), err)
            return False
        if req.adapter and new:
            self.requests.labels(adapter=req.adapter).inc()
        return True

    def emitted(self, rows) -> None:
        for row in rows:
            if row.token_id >= 0 and row.seq.req.adapter:
                self.tokens.labels(adapter=row.seq.req.adapter).inc()

    # ---- changes --------------------------------------------------------------------------
    def request(self, msg: LoadAdapter | UnloadAdapter) -> None:
        """A load or unload from http: refused at once when it cannot apply, else queued."""
        name = msg.name
        queued = {m.name for m in self.queue if isinstance(m, LoadAdapter)}
        if self.inflight is not None and isinstance(self.inflight.msg, LoadAdapter):
            queued.add(self.inflight.msg.name)
        if isinstance(msg, LoadAdapter):
            if name in self.wanted or name in queued:
                return self._done(msg, f"The lora adapter '{name}' has already been loaded.", 400)
            if name in (self.model_id, "tgi"):
                return self._done(msg, f"The lora adapter name '{name}' names the base model.", 400)
        else:
            if name not in self.accepting:
                return self._done(msg, f"The lora adapter '{name}' cannot be found.", 404)
            self.accepting.pop(name, None)  # new requests are refused from now on
            self._save()
            self.announce()
        self.queue.append(msg)
        self.tick()

    def tick(self) -> None:
        """Start the next change when none is out and its adapter is free (an unload waits for its requests)."""
        if self.inflight is not None or not self.queue:
            return
        msg = self.queue[0]
        if isinstance(msg, UnloadAdapter):
            if self.batcher.adapter_in_use(msg.name):
                return
            del self.wanted[msg.name]
            self.generations.pop(msg.name, None)
            self.batcher.key_adapter(msg.name, None)
        else:
            self.loads += 1
            self.wanted[msg.name] = msg.path
            self.generations[msg.name] = self.loads
            self.batcher.key_adapter(msg.name, f"{msg.name}\0{self.loads}")
        self.queue.popleft()
        self.ops += 1
        self.inflight = _Op(self.ops, msg)
        self._save()  # the load counter: a successor never reuses a generation the shards may hold
        self.resend()

    def resend(self) -> None:
        """The run-time set to every rank (also after a probe: a restarted shard reloads it)."""
        op = self.inflight.op if self.inflight is not None else 0
        msg = ShardAdapters(op=op, adapters=dict(self.wanted), generations=dict(self.generations))
        self.to_shards(msg)

    def ack(self, msg: ShardAdaptersAck) -> None:
        op = self.inflight
        if op is None or msg.op != op.op:
            return  # the answer to a resend after a probe
        op.acks[msg.rank] = msg.errors
        if len(op.acks) < self.ranks:
            return
        self.inflight = None
        name = op.msg.name
        if isinstance(op.msg, UnloadAdapter):
            log.info("LoRA adapter %s unloaded", name)
            self._done(op.msg, None, 200)
        else:
            errors = [e[name] for e in op.acks.values() if name in e]
            if errors:  # ranks that loaded it drop it again
                self.wanted.pop(name, None)
                self.generations.pop(name, None)
                self.batcher.key_adapter(name, None)
                self.resend()
                log.warning("LoRA adapter %s refused: %s", name, errors[0])
                self._done(op.msg, errors[0], 400)
            else:
                self.accepting[name] = None
                self._save()
                log.info("LoRA adapter %s loaded from %s", name, op.msg.path)
                self.announce()  # before the answer: the tokenizers hear the name first
                self._done(op.msg, None, 200)
        self.tick()

    def announce(self) -> None:
        """The names new requests may use, to http and the tokenizers (on every change and every heartbeat)."""
        names = list(self.accepting)
        self.loaded.labels(replica=str(self.replica)).set(len(names))
        self.publish(topics.lora(self.replica), AdapterSet(replica=self.replica, names=names))

    # ---- across restarts -------------------------------------------------------------------
    def _save(self) -> None:
        """The served set (the names new requests may use, with folder and generation) and the load counter."""
        if self.state_path is None:
            return
        adapters = [[name, self.wanted[name], self.generations.get(name, 0)] for name in self.accepting]
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"loads": self.loads, "adapters": adapters}))
            os.replace(tmp, self.state_path)
        except OSError as e:  # the run directory is gone: the server is stopping
            log.warning("could not record the LoRA adapters in %s: %s", self.state_path, e)

    def _restore(self) -> list[str]:
        """Take over the set a predecessor served (nothing on a first start: the start-up list stands)."""
        if self.state_path is None or not self.state_path.exists():
            return []
        try:
            state = json.loads(self.state_path.read_text())
            adapters = [(str(name), str(path), int(gen)) for name, path, gen in state["adapters"]]
            loads = int(state["loads"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignored the recorded LoRA adapters in %s: %s", self.state_path, e)
            return []
        self.loads = loads
        self.wanted = {name: path for name, path, _ in adapters}
        self.generations = {name: gen for name, _, gen in adapters if gen}
        for name, gen in self.generations.items():
            self.batcher.key_adapter(name, f"{name}\0{gen}")
        log.info("LoRA adapters taken over from the previous scheduler: %s", ", ".join(self.wanted) or "none")
        return list(self.wanted)

    def _done(self, msg: LoadAdapter | UnloadAdapter, error: str | None, status: int) -> None:
        done = AdapterDone(op_id=msg.op_id, replica=self.replica, error=error, status=status)
        self.publish(topics.out(msg.ingress), done)
