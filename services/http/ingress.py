"""The http process's side of the bus: submit requests, route events back to open requests.

One reader task takes everything addressed to this ingress (`out.<n>`) and every heartbeat, and
hands each event to the asyncio queue of its request; handlers only ever await their own queue.
Every heartbeat heard also feeds the metrics Aggregator behind /metrics (`metrics_text`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from libs.protocol import Addresses, ProtocolError, codec, topics
from libs.protocol.messages import (
    Abort,
    Accepted,
    GenerateRequest,
    Heartbeat,
    Hello,
    RequestError,
    TextBatch,
    TextRow,
    TokenizeResult,
)
from libs.runtime import bus, metrics, tracing
from libs.runtime.liveness import Liveness
from libs.runtime.settings import Settings
from services.http import observe

log = logging.getLogger("switchyard.http")

ADMIT_TIMEOUT = 30.0  # seconds for a request to be accepted or rejected once submitted
ERROR_STATUS = {
    "validation": 422,
    "template_error": 422,
    "overloaded": 429,
    "generation": 424,
    "incomplete_generation": 500,
    "unavailable": 503,
}


class Failure(Exception):
    """A request ended in an error, in TGI's shape."""

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.message, self.error_type = message, error_type

    @property
    def status(self) -> int:
        return ERROR_STATUS.get(self.error_type, 500)

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


@dataclass
class Timing:
    """When (time.monotonic) a request passed each point this process can see.

    The http process never sees the queue or the prefill directly: `accepted` (the router placed
    the request) closes validation, the first token row closes queueing plus prefill, the last row
    closes inference. The x-*-time headers (services.http.middleware) are built from these.
    """

    start: float
    accepted: float | None = None
    first: float | None = None
    last: float | None = None
    input_length: int = 0


class Ingress:
    def __init__(self, bus_spec: str, index: int, settings: Settings | None = None):
        self.index = index
        # http does not run through service.run: its metrics and tracing start here
        settings = settings if settings is not None else Settings.from_env()
        metrics.init("http", index, settings)
        self.agg = metrics.Aggregator("http", index)
        tracing.init(settings.otlp_service_name, settings.otlp_endpoint, role="http", index=str(index))
        self.out_topic = topics.out(index)
        self.hb_topic = topics.hb("http", index)
        addresses = Addresses.parse(bus_spec)
        ctx = zmq.asyncio.Context.instance()
        self.push = bus.socket(zmq.PUSH, connect=addresses.intake, ctx=ctx)
        self.pub = bus.socket(zmq.PUB, connect=addresses.events_in, ctx=ctx)
        self.sub = bus.socket(zmq.SUB, connect=addresses.events_out, ctx=ctx)
        for topic in (self.out_topic, topics.HB):
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.queues: dict[str, asyncio.Queue] = {}
        self.replica_of: dict[str, int] = {}
        self.abandoned: set[str] = set()  # aborted before the router told us the replica
        self.liveness = Liveness()
        self._hello = secrets.token_hex(8)
        self._confirmed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # request ids not to count as requests of their own (best_of's other sequences, as TGI)
        self.quiet: set[str] = set()

    async def publish(self, topic: bytes, msg) -> None:
        await self.pub.send_multipart(codec.encode_pub(topic, msg), copy=False)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._heartbeat())]
        while not self._confirmed.is_set():  # our hello back proves the event bus carries our topics
            await self.publish(self.hb_topic, Hello(nonce=self._hello))
            try:
                await asyncio.wait_for(self._confirmed.wait(), 0.2)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        tracing.shutdown()

    async def _heartbeat(self) -> None:
        while True:
            hb = Heartbeat(
                role="http",
                index=self.index,
                pid=os.getpid(),
                running=len(self.queues),
                metrics=metrics.exposition(),  # for the other http processes' /metrics
            )
            await self.publish(self.hb_topic, hb)
            await asyncio.sleep(1.0)

    async def _read(self) -> None:
        while True:
            frames = await self.sub.recv_multipart(copy=False)
            try:
                _, msg = codec.decode_pub([f.buffer for f in frames])
            except ProtocolError as e:
                log.warning("dropped malformed event: %s", e)
                continue
            if isinstance(msg, TextBatch):
                for row in msg.rows:
                    q = self.queues.get(row.request_id)
                    if q is not None:
                        q.put_nowait(row)
            elif isinstance(msg, Heartbeat):
                self.liveness.record(msg)
                self.agg.observe(msg)
            elif isinstance(msg, Accepted):
                if msg.request_id in self.abandoned:
                    self.abandoned.discard(msg.request_id)
                    await self.publish(topics.ctl(msg.replica), Abort(request_id=msg.request_id))
                elif msg.request_id in self.queues:
                    self.replica_of[msg.request_id] = msg.replica
                    self.queues[msg.request_id].put_nowait(msg)
            elif isinstance(msg, (RequestError, TokenizeResult)):
                q = self.queues.get(msg.request_id)
                if q is not None:
                    q.put_nowait(msg)
            elif isinstance(msg, Hello) and msg.nonce == self._hello:
                self._confirmed.set()

    def metrics_text(self) -> str:
        """/metrics: every process's registry merged, then what heartbeats say of each process."""
        return self.agg.render() + observe.legacy_text(self.liveness)

    def healthy(self) -> bool:
        lv = self.liveness
        return bool(lv.alive("router") and lv.alive("tokenizer") and lv.alive("detokenizer") and lv.ready("scheduler"))

    async def tokenize(self, req: GenerateRequest) -> TokenizeResult:
        """Submit a mode="tokenize" request and return its tokens; raises Failure."""
        if not self.liveness.alive("tokenizer"):
            raise Failure("No tokenizer is available", "unavailable")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[req.request_id] = q
        try:
            await self.push.send_multipart(codec.encode(req), copy=False)
            try:
                event = await asyncio.wait_for(q.get(), ADMIT_TIMEOUT)
            except TimeoutError:
                raise Failure("Request was not admitted in time", "unavailable") from None
        finally:  # the tokenizer forwards nothing in this mode, so there is nothing to abort
            self.queues.pop(req.request_id, None)
        if isinstance(event, RequestError):
            raise Failure(event.message, event.error_type)
        return event

    async def generate(self, req: GenerateRequest, timing: Timing | None = None) -> AsyncIterator[TextRow]:
        """Submit `req` and yield its text rows up to the final one; raises Failure.

        `timing`, when given, is filled in as the request passes each point (see Timing). Every request
        is recorded here (observe.RequestRecord): TGI's request metrics, the http span, the log line.
        """
        rid = req.request_id
        if timing is None:  # a stream: its clock starts when http read it
            now = time.monotonic()
            timing = Timing(start=now - max(0.0, time.time() - req.received_at) if req.received_at else now)
        record = observe.RequestRecord(req, timing, quiet=rid in self.quiet)
        self.quiet.discard(rid)
        if not self.liveness.alive("tokenizer"):
            record.failure("No tokenizer is available", "unavailable")
            raise Failure("No tokenizer is available", "unavailable")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        done = False
        try:
            await self.push.send_multipart(codec.encode(req), copy=False)
            try:
                first = await asyncio.wait_for(q.get(), ADMIT_TIMEOUT)
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
                    timing.accepted, timing.input_length = now, event.input_length
                    record.accepted(event.input_length, event.max_new_tokens)
                elif isinstance(event, TextRow):
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
            replica = self.replica_of.pop(rid, None)
            if not done:  # the client went away (or we failed): stop the work
                record.dropped()
                if replica is None:
                    self.abandoned.add(rid)
                else:
                    await self.publish(topics.ctl(replica), Abort(request_id=rid))
