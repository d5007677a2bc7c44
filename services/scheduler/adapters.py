"""LoRA adapters loaded and unloaded while serving, as one replica's scheduler runs them (docs/lora.md).

The scheduler owns the replica's run-time set (`wanted`: name → folder). A change goes to the shards as the whole
set (`ShardAdapters`) on the plan stream, so every tensor-parallel rank applies it between the same two steps, and
a shard that restarts gets the same message after the probe and reloads what was loaded at run time. Changes run
one at a time; the next starts once every rank acked the last.

- load: the name is accepted (announced, admitted) only after every rank loaded it; a rank's refusal undoes it on
  the others and answers 400 with the reason;
- unload: the name stops being accepted at once (announced; a request that still arrives is refused as unknown),
  and the shards drop it once no request of this replica runs or waits with it.

Each load has a generation that seeds the adapter's prefix-cache hashes, so blocks cached by an earlier adapter
of the same name never serve the new one.

The served set outlives the scheduler: every change is written to the server's run directory
(`lora-replica-<r>.json`, atomically), and a restarted scheduler starts from it instead of the start-up list.
So after a `kill -9` it sends its shards the set they hold (same folders, same generations: nothing is reloaded)
and announces the same names, and a resubmitted request on a run-time adapter is served, not refused.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from libs.protocol import topics
from libs.protocol.adapters import AdapterDone, AdapterSet, LoadAdapter, ShardAdapters, ShardAdaptersAck, UnloadAdapter
from libs.protocol.messages import RequestError, TokenizedRequest
from libs.runtime import bus, metrics

log = logging.getLogger("switchyard.scheduler")


@dataclass
class _Op:
    op: int
    msg: LoadAdapter | UnloadAdapter
    acks: dict[int, dict[str, str]] = field(default_factory=dict)  # rank → its refusals


class AdapterControl:
    def __init__(self, service) -> None:
        self.svc = service
        s = service.settings
        self.ranks = max(1, s.num_shard)
        self.wanted: dict[str, str] = dict(e.split("=", 1) for e in s.lora_adapters.split(",") if e)
        self.generations: dict[str, int] = {}  # start-up adapters have generation 0 (absent)
        self.queue: deque[LoadAdapter | UnloadAdapter] = deque()
        self.inflight: _Op | None = None
        self.ops = self.loads = 0
        run_dir = os.environ.get("SWITCHYARD_RUN_DIR")
        self.state_path = Path(run_dir) / f"lora-replica-{service.replica}.json" if run_dir else None
        self.restored = self._restore()  # the names a restarted scheduler took over from its predecessor
        self.accepting: dict[str, None] = dict.fromkeys(self.wanted)  # ordered: start-up order, then loads
        m = metrics.get()
        if m is None:  # a scheduler built without service.run (tests): metrics of its own, unexported
            m = metrics.Metrics("scheduler", service.replica)
        self.requests, self.tokens, self.loaded = m.lora_requests, m.lora_generated_tokens, m.lora_adapters_loaded
        self.loaded.labels(replica=str(service.replica)).set(len(self.accepting))

    # ---- requests -------------------------------------------------------------------------
    def admits(self, req: TokenizedRequest) -> bool:
        """False (and the request refused as the tokenizer would) when it names an adapter not served now: one
        being unloaded, whose refusal overtook the tokenizer's check."""
        if req.adapter and req.adapter not in self.accepting:
            message = f"`adapter_id` `{req.adapter}` is not a loaded LoRA adapter"
            err = RequestError(request_id=req.request_id, message=message, error_type="validation")
            self.svc.events.publish(topics.out(req.ingress), err)
            return False
        if req.adapter and req.request_id not in self.svc.batcher.by_request:
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
            if name in (self.svc.settings.model_id, "tgi"):
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
            if any(s.req.adapter == msg.name for s in self.svc.batcher.by_request.values()):
                return
            del self.wanted[msg.name]
            self.generations.pop(msg.name, None)
            self.svc.batcher.hash_keys.pop(msg.name, None)
        else:
            self.loads += 1
            self.wanted[msg.name] = msg.path
            self.generations[msg.name] = self.loads
            self.svc.batcher.hash_keys[msg.name] = f"{msg.name}\0{self.loads}"
        self.queue.popleft()
        self.ops += 1
        self.inflight = _Op(self.ops, msg)
        self._save()  # the load counter: a successor never reuses a generation the shards may hold
        self.resend()

    def resend(self) -> None:
        """The run-time set to every rank (also after a probe: a restarted shard reloads it)."""
        op = self.inflight.op if self.inflight is not None else 0
        msg = ShardAdapters(op=op, adapters=dict(self.wanted), generations=dict(self.generations))
        bus.send(self.svc.plans, msg)

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
            self.svc.log.info("LoRA adapter %s unloaded", name)
            self._done(op.msg, None, 200)
        else:
            errors = [e[name] for e in op.acks.values() if name in e]
            if errors:  # ranks that loaded it drop it again
                self.wanted.pop(name, None)
                self.generations.pop(name, None)
                self.svc.batcher.hash_keys.pop(name, None)
                self.resend()
                self.svc.log.warning("LoRA adapter %s refused: %s", name, errors[0])
                self._done(op.msg, errors[0], 400)
            else:
                self.accepting[name] = None
                self._save()
                self.svc.log.info("LoRA adapter %s loaded from %s", name, op.msg.path)
                self.announce()  # before the answer: the tokenizers hear the name first
                self._done(op.msg, None, 200)
        self.tick()

    def announce(self) -> None:
        """The names new requests may use, to http and the tokenizers (on every change and every heartbeat)."""
        names = list(self.accepting)
        self.loaded.labels(replica=str(self.svc.replica)).set(len(names))
        self.svc.events.publish(topics.lora(self.svc.replica), AdapterSet(replica=self.svc.replica, names=names))

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
            self.svc.batcher.hash_keys[name] = f"{name}\0{gen}"
        log.info("LoRA adapters taken over from the previous scheduler: %s", ", ".join(self.wanted) or "none")
        return list(self.wanted)

    def _done(self, msg: LoadAdapter | UnloadAdapter, error: str | None, status: int) -> None:
        done = AdapterDone(op_id=msg.op_id, replica=self.svc.replica, error=error, status=status)
        self.svc.events.publish(topics.out(msg.ingress), done)
