"""The http process's side of the bus: submit requests, route events back to open requests.

One reader task takes everything addressed to this ingress (`out.<n>`) and every heartbeat, and
hands each event to the asyncio queue of its request; handlers only ever await their own queue.
Every heartbeat heard also feeds the metrics Aggregator behind /metrics (`metrics_text`).

No request is lost when another process dies: http holds every open request and acts on silence (`_watch`:
resubmit, resync, give up), and a request that comes while the tokenizer is restarting waits for it
(`_heard`). docs/recovery.md tells the protocol, with the state table of a request as seen from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from libs.protocol import Addresses, codec, topics
from libs.protocol.lora import AdapterDone, AdapterSet
from libs.protocol.messages import (
    Abort,
    Accepted,
    GenerateRequest,
    Heartbeat,
    RequestError,
    Resync,
    TextBatch,
    TextRow,
    TokenizeResult,
    Unknown,
)
from libs.runtime import bus, metrics, tracing
from libs.runtime.async_bus import AsyncEventBus
from libs.runtime.liveness import Liveness
from libs.runtime.settings import Settings
from libs.runtime.timeouts import ABANDONED_KEEP_S, ADMIT_TIMEOUT, GIVE_UP_S, STALL_S
from services.http import lora, models, telemetry
from services.http.errors import LOST, Failure
from services.http.timing import Timing

log = logging.getLogger("switchyard.http")


async def next_event(q: asyncio.Queue, seconds: float):
    """The queue's next event, or TimeoutError after `seconds`. Not asyncio.wait_for: on Python 3.11 it returns
    the result and swallows a cancel that lands as the event arrives (a client that leaves just as its request
    is accepted: a batch of them at once), and the request then runs to its end for no one."""
    async with asyncio.timeout(seconds):
        return await q.get()


def no_tokenizer(model: str) -> str:
    """The 503's message when no tokenizer of a request's model lives."""
    return f"No tokenizer of model `{model}` is available" if model else "No tokenizer is available"


@dataclass
class Pending:
    """A generate request in flight, as the watchdog sees it."""

    req: GenerateRequest
    queue: asyncio.Queue
    submitted: float  # when it was last (re)submitted
    heard: float  # when the last event for it came (or it was submitted)
    replica: int | None = None  # from Accepted
    delivered: int = 0  # index of the last row handed to the client
    asked: float = 0.0  # when the last Resync went


class Ingress:
    def __init__(self, bus_spec: str, index: int, settings: Settings | None = None):
        self.index = index
        # http does not run through service.run: its metrics and tracing start here
        settings = settings if settings is not None else Settings.from_env()
        metrics.init("http", index, settings)
        self.agg = metrics.Aggregator("http", index)
        tracing.init(settings.otlp_service_name, settings.otlp_endpoint, role="http", index=str(index))
        addresses = Addresses.parse(bus_spec)
        self.push = bus.socket(zmq.PUSH, connect=addresses.intake, ctx=zmq.asyncio.Context.instance())
        self.events = AsyncEventBus(addresses, "http", index, subscribe=[topics.out(index), topics.HB, topics.LORA])
        self.queues: dict[str, asyncio.Queue] = {}
        self.replica_of: dict[str, int] = {}
        self.abandoned: dict[str, float] = {}  # aborted before the router told us the replica → when (expires)
        self.pending: dict[str, Pending] = {}
        self.replicas = max(1, settings.replicas)  # a seed: the replicas counted before any is heard
        self.liveness = Liveness()
        models.FLEET.attach(self.liveness, settings.model_id)  # the served models, from the same heartbeats
        self._heard_now: dict[str, asyncio.Event] = {}  # role → set when one of it is heard (`_heard`)
        self._tasks: list[asyncio.Task] = []
        # request ids not to count as requests of their own (best_of's other sequences, as TGI)
        self.quiet: set[str] = set()

    async def publish(self, topic: bytes, msg) -> None:
        await self.events.publish(topic, msg)

    async def start(self) -> None:
        await self.events.start()  # our hello back proves the event bus carries our topics
        self._tasks = [
            asyncio.create_task(self._read()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._watch()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        tracing.shutdown()

    async def _heartbeat(self) -> None:
        while True:  # its metrics feed the other http processes' /metrics
            await self.events.heartbeat(running=len(self.queues))
            await asyncio.sleep(self.events.heartbeat_in())

    async def _read(self) -> None:
        while True:
            got = await self.events.recv()
            if got is None:
                continue
            msg = got[1]
            p = self.pending.get(getattr(msg, "request_id", ""))
            if p is not None:
                p.heard = time.monotonic()
            if isinstance(msg, TextBatch):
                now = time.monotonic()
                for row in msg.rows:
                    p = self.pending.get(row.request_id)
                    if p is not None:
                        p.heard = now
                    q = self.queues.get(row.request_id)
                    if q is not None:
                        q.put_nowait(row)
            elif isinstance(msg, Heartbeat):
                if not self.liveness.record(msg):  # a second run claiming a live identity: not its series
                    continue
                self.agg.observe(msg)
                now = time.monotonic()
                for rid in msg.holding:  # a tokenizer still works on it (an image): not silent, no resubmission
                    if (p := self.pending.get(rid)) is not None:
                        p.heard = now
                heard = self._heard_now.pop(msg.role, None)
                if heard is not None:
                    heard.set()
            elif isinstance(msg, Accepted):
                if msg.request_id in self.abandoned:
                    self.abandoned.pop(msg.request_id, None)
                    await self.publish(topics.ctl(msg.replica), Abort(request_id=msg.request_id))
                elif msg.request_id in self.queues:
                    self.replica_of[msg.request_id] = msg.replica
                    if p is not None:
                        p.replica = msg.replica
                    self.queues[msg.request_id].put_nowait(msg)
            elif isinstance(msg, Unknown):
                if p is not None:  # its scheduler restarted without it: submit it again
                    log.info("scheduler lost the request: resubmitting", extra={"request_id": msg.request_id})
                    await self._submit(p)
            elif isinstance(msg, (RequestError, TokenizeResult)):
                q = self.queues.get(msg.request_id)
                if q is not None:
                    q.put_nowait(msg)
            elif isinstance(msg, AdapterSet) and models.FLEET.foreign(msg.replica):
                continue  # another model's adapters: its own tokenizers check its requests' names
            elif isinstance(msg, (AdapterSet, AdapterDone)):  # LoRA adapters loaded or unloaded while serving
                lora.on_event(msg, self)

    async def _send(self, req: GenerateRequest) -> None:
        """To a tokenizer: the default model's through intake, another model's to one of its own by name."""
        if not req.model:
            await self.push.send_multipart(codec.encode(req), copy=False)
            return
        n = models.FLEET.tokenizer_for(req.model)
        if n is None:
            raise Failure(no_tokenizer(req.model), "unavailable")
        await self.publish(topics.tokenize(n), req)

    async def _submit(self, p: Pending) -> None:
        p.submitted = p.heard = time.monotonic()
        p.replica = None
        try:
            await self._send(p.req)
        except Failure as e:  # none of its model's tokenizers is alive now: the watchdog tries again, then gives up
            log.info("resubmitting: %s", e.message, extra={"request_id": p.req.request_id})

    async def resync(self, p: Pending) -> None:
        p.asked = time.monotonic()
        if p.replica is not None:
            resync = Resync(request_id=p.req.request_id, ingress=self.index, delivered=p.delivered)
            await self.publish(topics.ctl(p.replica), resync)

    async def _watch(self) -> None:
        """Act on silence: resubmit what was never accepted, resync what was, fail what stays silent."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for rid, t in list(self.abandoned.items()):  # Accepted never came: nothing left to abort
                if now - t > ABANDONED_KEEP_S:
                    del self.abandoned[rid]
            live: dict[str, set[int]] = {}  # model → its replicas alive now
            for hb in self.liveness.alive("scheduler"):
                live.setdefault(hb.model or models.FLEET.default, set()).add(hb.index)
            for p in list(self.pending.values()):
                quiet = now - p.heard
                try:
                    if quiet > GIVE_UP_S:
                        error = RequestError(request_id=p.req.request_id, message=LOST, error_type="generation")
                        p.queue.put_nowait(error)
                        p.heard = now
                    elif p.replica is None and now - p.submitted > STALL_S and quiet > STALL_S:
                        if now - p.submitted < ADMIT_TIMEOUT:  # after it, generate() fails the request
                            log.info("no answer: resubmitting", extra={"request_id": p.req.request_id})
                            await self._submit(p)
                    elif (
                        p.replica is not None
                        and quiet > STALL_S
                        and p.replica not in (others := live.get(p.req.model or models.FLEET.default, set()))
                        and others
                    ):
                        # its replica is gone (silent for a heartbeat lifetime, or it left) while others of its model
                        # live: no one would answer a resync, so it goes where the router places it now (same id)
                        log.info("replica %d is gone: resubmitting", p.replica, extra={"request_id": p.req.request_id})
                        await self._submit(p)
                    elif p.replica is not None and quiet > STALL_S and now - p.asked > STALL_S:
                        await self.resync(p)
                except zmq.ZMQError as e:
                    log.warning("watchdog: %s", e)

    def live_replicas(self) -> list[int]:
        """Where an abort of a request not yet placed goes: every replica alive now (the live membership, from
        heartbeats: one that joined after start included, one gone left out); the configured ones before any is
        heard. A copy placed later is aborted when its Accepted comes (`abandoned`)."""
        return [hb.index for hb in self.liveness.alive("scheduler")] or list(range(self.replicas))

    def metrics_text(self) -> str:
        """/metrics: every process's registry merged, then what heartbeats say of each process."""
        return self.agg.render() + telemetry.legacy_text(self.liveness)

    def healthy(self) -> bool:
        lv = self.liveness
        return bool(lv.alive("router") and lv.alive("tokenizer") and lv.alive("detokenizer") and lv.ready("scheduler"))

    async def _heard(self, role: str, request_id: str, model: str = "") -> bool:
        """Whether a process of `role` serving `model` ("": the default one) is alive, waiting first while one is
        awaited (restarting: lost less than RESTART_WAIT_S ago, see Liveness.awaited), as the router waits for a
        detokenizer and a scheduler. Another model's processes do not count: intake reaches only the default
        model's tokenizers, so with none of them a default-model request would wait there for nobody."""
        which = models.FLEET.of_model(model)
        if not self.liveness.awaited(role, which):
            return bool(self.liveness.alive(role, which))
        log.info("no live %s yet: the request waits for one", role, extra={"request_id": request_id})
        started = time.monotonic()
        while (left := self.liveness.wait_left(role, which)) > 0.0:
            heard = self._heard_now.setdefault(role, asyncio.Event())
            try:
                async with asyncio.timeout(left):
                    await heard.wait()
            except TimeoutError:
                pass
        alive = bool(self.liveness.alive(role, which))
        waited = time.monotonic() - started
        log.info(
            "%s after %.1f s",
            f"a {role} is back" if alive else f"no {role} came",
            waited,
            extra={"request_id": request_id},
        )
        return alive

    async def tokenize(self, req: GenerateRequest) -> TokenizeResult:
        """Submit a mode="tokenize" request and return its tokens; raises Failure."""
        if not await self._heard("tokenizer", req.request_id, req.model):
            raise Failure(no_tokenizer(req.model), "unavailable")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[req.request_id] = q
        try:
            await self._send(req)
            try:
                event = await next_event(q, ADMIT_TIMEOUT)
            except TimeoutError:
                raise Failure("Request was not admitted in time", "unavailable") from None
        finally:  # the tokenizer forwards nothing in this mode, so there is nothing to abort
            self.queues.pop(req.request_id, None)
        if isinstance(event, RequestError):
            raise Failure(event.message, event.error_type)
        return event

    async def end_all(self, message: str, error_type: str) -> int:
        """End every request still open with `message`, its stream's final error event, and abort its work
        (a drain past its timeout); returns how many were ended."""
        for rid, q in list(self.queues.items()):
            replica = self.replica_of.get(rid)
            for r in self.live_replicas() if replica is None else (replica,):
                await self.publish(topics.ctl(r), Abort(request_id=rid))
            q.put_nowait(RequestError(request_id=rid, message=message, error_type=error_type))
        return len(self.queues)

    def ready(self, request_id: str) -> bool:
        """Whether more of this request's rows already wait (the rest of a step's): a writer may hold its events
        until they are in. Rows only: an Accepted keepalive next would leave held events waiting for the next step
        (a replayed row that `generate` drops can, after a resync only)."""
        q = self.queues.get(request_id)
        return q is not None and any(isinstance(e, TextRow) for e in q._queue)  # asyncio.Queue's deque, in order

    async def generate(self, req: GenerateRequest, timing: Timing | None = None) -> AsyncIterator[TextRow]:
        """Submit `req` and yield its text rows up to the final one; raises Failure.

        `timing`, when given, is filled in as the request passes each point (see Timing). Every request
        is recorded here (telemetry.RequestRecord): TGI's request metrics, the http span, the log line.
        """
        rid = req.request_id
        if timing is None:  # a stream: its clock starts when http read it
            now = time.monotonic()
            timing = Timing(start=now - max(0.0, time.time() - req.received_at) if req.received_at else now)
        record = telemetry.RequestRecord(req, timing, quiet=rid in self.quiet)
        self.quiet.discard(rid)
        try:
            heard = await self._heard("tokenizer", rid, req.model)
        except asyncio.CancelledError:  # the client went away while it waited: nothing was sent
            record.dropped()
            raise
        if not heard:
            record.failure(no_tokenizer(req.model), "unavailable")
            raise Failure(no_tokenizer(req.model), "unavailable")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        now = time.monotonic()
        self.pending[rid] = p = Pending(req, q, now, now)
        done = False
        try:
            # one turn of the loop first: a client already gone (it sent and closed) cancels us before any work
            for _ in range(3):
                await asyncio.sleep(0)
            await self._send(req)
            try:
                first = await next_event(q, ADMIT_TIMEOUT)
            except TimeoutError:
                record.failure("Request was not admitted in time", "unavailable")
                raise Failure("Request was not admitted in time", "unavailable") from None
            while True:
                event = first if first is not None else await q.get()
                first = None
                if isinstance(event, RequestError):
                    done = True
                    record.failure(event.message, event.error_type)
                    raise Failure(event.message, event.error_type)
                now = time.monotonic()
                if isinstance(event, Accepted):
                    if timing.input_length == 0:  # later ones: a resubmission's, or a waiting request's keepalive
                        timing.accepted, timing.input_length = now, event.input_length
                        record.accepted(event.input_length, event.max_new_tokens)
                elif isinstance(event, TextRow):
                    # a replay (resync) repeats rows: drop those delivered; a gap: ask for the whole stream
                    last = p.delivered
                    if event.index > last + 1:
                        if now - p.asked > 0.5:  # once per gap, not once per row past it
                            await self.resync(p)
                        continue
                    if event.index <= last and (event.final is None or event.index < last):
                        continue
                    p.delivered = event.index
                    timing.accepted = timing.accepted or now  # rows may overtake Accepted (other topics)
                    timing.first = timing.first or now
                    timing.last = now
                    record.row(now)
                    if event.final is not None:
                        done = True
                        record.success(event.final)
                    yield event
                    if done:
                        return
        finally:
            self.queues.pop(rid, None)
            self.pending.pop(rid, None)
            replica = self.replica_of.pop(rid, None)
            if not done:  # the client went away (or we failed): stop the work
                record.dropped()
                if replica is None:  # abort it wherever it lands, and when its Accepted comes
                    self.abandoned[rid] = time.monotonic()
                    for r in self.live_replicas():
                        await self.publish(topics.ctl(r), Abort(request_id=rid))
                else:
                    await self.publish(topics.ctl(replica), Abort(request_id=rid))
