"""`python -m services.tokenizer`: render chat templates, validate as TGI does, tokenize, forward to admit.

It keeps nothing across requests: a request lost with it is resubmitted by http, and one that comes while it
restarts waits in http (docs/recovery.md).

Several models behind one router: a tokenizer of the router's own model (the default) takes requests from intake,
as the only kind did before; one of another model never joins intake (it would get the default model's requests)
and takes only those http addresses to it by name on `tokenize.<n>`. Which one it is, the router's heartbeat says.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

# one process = one core's worth of tokenizing: the Rust pool would fight the shard for cores
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import zmq
from opentelemetry.trace import Status, StatusCode

from libs.protocol import Addresses, topics
from libs.protocol.lora import AdapterSet
from libs.protocol.messages import ChatFormatNote, GenerateRequest, Heartbeat, RequestError, TokenizedRequest
from libs.runtime import bus, metrics, service, tracing
from libs.runtime.settings import Settings
from services.tokenizer.images.lane import Lane
from services.tokenizer.images.processor import holds_images
from services.tokenizer.processor import Processor, Result

ROLE = "tokenizer"
ANNOUNCE_WAIT_S = 2.5  # the schedulers announce their LoRA adapters with every heartbeat (1 s)
log = logging.getLogger("switchyard.tokenizer")


class TokenizerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        addresses = Addresses.parse(settings.bus)
        self.processor = Processor.from_settings(settings)
        self.addresses = addresses
        self.inbox: zmq.Socket | None = None  # intake's requests, once the router says its model is ours (_join)
        self.admit = bus.socket(zmq.PUSH, connect=addresses.admit)
        # the LoRA adapters the schedulers serve now (loaded and unloaded while serving), requests for our model by
        # name, the router's heartbeat (its model) and the schedulers' (theirs)
        subscribe = [topics.LORA, topics.tokenize(settings.index), topics.HB + b"router.", topics.HB + b"scheduler."]
        self.events = bus.EventBus(addresses, ROLE, settings.index, subscribe=subscribe)
        self.named: deque[GenerateRequest] = deque()  # requests heard on tokenize.<n>, in order
        self.poller = zmq.Poller()
        self.poller.register(self.events.sub, zmq.POLLIN)
        self._apart = False  # said once: the router serves another model
        self.foreign: set[int] = set()  # replicas of another model: their adapter sets are not ours
        self.handled = self.rejected = self.tokenized = 0
        self.processor.grammars.on_wait = self._beat_on_loop  # a long grammar compile still beats
        # a vision model's requests with images go to the lane (images/lane.py); None: a text-only model
        self.lane = Lane(self._process, settings.image_nice) if self.processor.images is not None else None
        if self.lane is not None:
            self.poller.register(self.lane.fd, zmq.POLLIN)
        # announced with every heartbeat: an http process whose own model is another reads our answers by it
        templates = self.processor.templates
        self.chat_format = ChatFormatNote(
            templates=templates.sources,
            bos_token=templates.bos_token,
            eos_token=templates.eos_token,
            tool_call_parser=settings.tool_call_parser,
            reasoning_parser=settings.reasoning_parser,
        )

    def handle(self, req: GenerateRequest) -> None:
        if self.lane is not None and holds_images(req.inputs, req.messages):
            # a copy http resubmitted before our beat named it as held: the lane will answer the one it has
            if not self.lane.held(req.request_id):
                self.lane.submit(req)  # fetched, decoded and tokenized off this loop (images/lane.py)
            return
        started = time.perf_counter()
        result = self._process(req)
        self._finish(req, result, time.perf_counter() - started)

    def _process(self, req: GenerateRequest) -> Result:
        # the tokenizer's span is a child of http's; the request carries it on to the router
        with tracing.span("tokenizer", req.traceparent, request_id=req.request_id, mode=req.mode) as sp:
            req.traceparent = tracing.traceparent_of(sp) or req.traceparent
            result = self.processor.process(req)
            if isinstance(result, RequestError) and sp.is_recording():
                sp.set_status(Status(StatusCode.ERROR, result.message))
        return result

    def _finish(self, req: GenerateRequest, result: Result, seconds: float) -> None:
        self._record(result, seconds)
        if isinstance(result, TokenizedRequest):
            self.handled += 1
            result.model = req.model  # the router places it on a replica of that model
            bus.send(self.admit, result)
            return
        # a TokenizeResult or a RequestError: either ends the request, on its http process's topic
        if isinstance(result, RequestError):
            self.rejected += 1
            log.info("rejected (%s): %s", result.error_type, result.message, extra={"request_id": req.request_id})
        else:
            self.tokenized += 1
        self.events.publish(topics.out(req.ingress), result)

    @staticmethod
    def _record(result, seconds: float) -> None:
        m = metrics.get()
        if m is None:
            return
        m.hop_duration.labels(hop="tokenizer").observe(seconds)
        ids = getattr(result, "input_ids", None)
        if ids is None:
            ids = getattr(result, "ids", None)  # a TokenizeResult
        if ids is not None:
            m.tokenized_tokens.inc(len(ids))

    def _drain_events(self, req: GenerateRequest | None = None) -> None:
        # A tokenizer that has heard no scheduler yet (just restarted) knows only the start-up adapters: a request
        # naming another one waits for the next announcement (once a second) before it may be refused.
        adapter = req.parameters.adapter_id if req is not None else None
        known = (*self.settings.lora_names, self.settings.model_id)
        wait = adapter and not self.processor.adapters.by_replica and adapter not in known
        deadline = time.monotonic() + ANNOUNCE_WAIT_S
        while self.events.sub.poll(max(0, int(1000 * (deadline - time.monotonic()))) if wait else 0):
            got = self.events.recv()  # LoRA adapter sets, requests by name, heartbeats (the router's, our own)
            if got is None:
                continue
            msg = got[1]
            if isinstance(msg, AdapterSet) and msg.replica not in self.foreign:
                self.processor.adapters.update(msg)
                wait = False
            elif isinstance(msg, GenerateRequest):
                self.named.append(msg)
            elif isinstance(msg, Heartbeat) and msg.role == "router" and self.inbox is None:
                self._join(msg)
            elif isinstance(msg, Heartbeat) and msg.role == "scheduler":
                if msg.model and msg.model != self.settings.model_id:
                    self.foreign.add(msg.index)
                else:
                    self.foreign.discard(msg.index)

    def _join(self, router: Heartbeat) -> None:
        """Take intake's requests when the router's model is ours (a router that names none: it is)."""
        if router.model and router.model != self.settings.model_id:
            if not self._apart:
                self._apart = True
                log.info(
                    "serving model %s beside the router's %s: taking only requests that name it",
                    self.settings.model_id,
                    router.model,
                )
            return
        self.inbox = bus.socket(zmq.PULL, connect=self.addresses.tokenize)
        self.poller.register(self.inbox, zmq.POLLIN)

    def run(self) -> None:
        self.events.start()
        while True:
            ready = dict(self.poller.poll(500))
            if self.lane is not None and self.lane.fd in ready:
                for req, result, seconds in self.lane.ready():
                    self._finish(req, result, seconds)
            if self.inbox is not None and self.inbox in ready:
                msg = bus.recv(self.inbox)
                if isinstance(msg, GenerateRequest):
                    self._drain_events(msg)  # an adapter announced just before this request counts
                    self.handle(msg)
            self._drain_events()
            while self.named:
                req = self.named.popleft()
                self._drain_events(req)
                self.handle(req)
            self._heartbeat()

    def _beat_on_loop(self) -> None:
        # the lane's threads wait on compiles too: they touch no socket, and the loop beats on its own meanwhile
        if threading.current_thread() is threading.main_thread():
            self._heartbeat()

    def _heartbeat(self) -> None:
        self.events.heartbeat(
            counters={"handled": self.handled, "rejected": self.rejected, "tokenized": self.tokenized},
            model=self.settings.model_id,
            chat_format=self.chat_format,
            holding=self.lane.holds() if self.lane is not None and self.events.heartbeat_due() else [],
        )


def main() -> None:
    def body(settings: Settings, log) -> None:
        tokenizer = TokenizerService(settings)
        log.info("tokenizer ready")
        tokenizer.run()

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
