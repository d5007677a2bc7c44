"""`python -m services.router`: bind the bus, proxy events, place requests.

A request placed again (http resubmits one it heard nothing of, issue 7) goes where it went the first time,
while that replica and detokenizer live, so the scheduler sees a duplicate it ignores, not a second run.

A router that has just (re)started has not heard every heartbeat yet: for one heartbeat lifetime
(STALE_AFTER) it holds a request while it knows no detokenizer or no scheduler, instead of failing it with
"No detokenizer is available" (or piling it on replica 0) while http's /health, which kept its own view across
the restart, says 200.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import zmq

from libs.protocol import Addresses, topics
from libs.protocol.messages import Accepted, Heartbeat, RequestError, TokenizedRequest
from libs.runtime import bus, metrics, service, tracing
from libs.runtime.liveness import Liveness
from libs.runtime.settings import Settings
from services.router.placement import Placement

ROLE = "router"
log = logging.getLogger("switchyard.router")


def proxy(frontend: zmq.Socket, backend: zmq.Socket) -> None:
    try:
        zmq.proxy(frontend, backend)
    except zmq.ZMQError:  # the sockets were closed under us at shutdown
        pass


class Router:
    def __init__(self, settings: Settings):
        self.settings = settings
        addresses = Addresses.parse(settings.bus)
        # intake streamer: http PUSH → PULL | PUSH → tokenizers PULL (fair-queued, load-balanced)
        self.intake = bus.socket(zmq.PULL, bind=addresses.intake)
        self.tokenize = bus.socket(zmq.PUSH, bind=addresses.tokenize)
        # event proxy: every process PUB → XSUB | XPUB → every process SUB
        self.events_in = bus.socket(zmq.XSUB, bind=addresses.events_in)
        self.events_out = bus.socket(zmq.XPUB, bind=addresses.events_out)
        for name, (a, b) in {
            "intake": (self.intake, self.tokenize),
            "events": (self.events_in, self.events_out),
        }.items():
            threading.Thread(target=proxy, args=(a, b), name=name, daemon=True).start()
        self.admit = bus.socket(zmq.PULL, bind=addresses.admit)
        self.replicas = [
            bus.socket(zmq.PUSH, connect=addresses.replica(r, "in")) for r in range(max(1, settings.replicas))
        ]
        self.events = bus.EventBus(addresses, ROLE, settings.index, subscribe=[topics.HB])
        self.liveness = Liveness()
        self.placement = Placement(len(self.replicas))
        self.placed = [0] * len(self.replicas)
        self._states: dict[tuple[str, int], tuple[int, bool]] = {}  # (role, index) → (pid, ready) last seen
        self._placed_ids: OrderedDict[str, tuple[int, int]] = OrderedDict()  # request id → (replica, detokenizer)
        self.held: list[TokenizedRequest] = []  # came before the heartbeats placement needs (_must_hold)

    def _must_hold(self) -> bool:
        return not self.liveness.settled() and not (
            self.liveness.alive("detokenizer") and self.liveness.alive("scheduler")
        )

    def _place_held(self) -> None:
        if self.held and not self._must_hold():
            held, self.held = self.held, []
            log.info("placing %d requests that came before the heartbeats they needed", len(held))
            for req in held:
                self.place(req)

    def _fail(self, req: TokenizedRequest, message: str) -> None:
        log.warning("cannot place request: %s", message, extra={"request_id": req.request_id})
        error = RequestError(request_id=req.request_id, message=message, error_type="unavailable")
        self.events.publish(topics.out(req.ingress), error)

    def place(self, req: TokenizedRequest) -> None:
        """Place one request, in the router's span (a child of the tokenizer's)."""
        if self._must_hold():
            self.held.append(req)
            return
        started = time.perf_counter()
        with tracing.span("router", req.traceparent, request_id=req.request_id) as sp:
            req.traceparent = tracing.traceparent_of(sp) or req.traceparent
            self._place(req)
            if sp.is_recording():
                sp.set_attributes({"replica": req.replica, "detokenizer": req.detokenizer})
        m = metrics.get()
        if m is not None:
            m.hop_duration.labels(hop="router").observe(time.perf_counter() - started)

    def _place(self, req: TokenizedRequest) -> None:
        # sticky per request: the whole stream goes through this one detokenizer
        detokenizers, schedulers = self.liveness.alive("detokenizer"), self.liveness.alive("scheduler")
        before = self._placed_ids.get(req.request_id)
        if (
            before is not None
            and before[0] in {hb.index for hb in schedulers}
            and before[1] in {hb.index for hb in detokenizers}
        ):
            replica, detokenizer = before
        else:
            detokenizer = self.placement.choose_detokenizer(detokenizers)
            if detokenizer is None:
                return self._fail(req, "No detokenizer is available")
            replica = self.placement.choose_replica(req.input_ids, schedulers)
            self._placed_ids[req.request_id] = (replica, detokenizer)
            if len(self._placed_ids) > 100_000:
                self._placed_ids.popitem(last=False)
        req.detokenizer, req.replica = detokenizer, replica
        bus.send(self.replicas[replica], req)
        self.placed[replica] += 1
        accepted = Accepted(
            request_id=req.request_id,
            replica=req.replica,
            input_length=len(req.input_ids),
            max_new_tokens=req.max_new_tokens,
        )
        self.events.publish(topics.out(req.ingress), accepted)

    def _log_change(self, hb: Heartbeat) -> None:
        """A process that appears, restarts (new pid) or changes readiness is worth a line."""
        key, state = (hb.role, hb.index), (hb.pid, hb.ready)
        if self._states.get(key) != state:
            self._states[key] = state
            log.info("%s.%d is up (pid %d)%s", hb.role, hb.index, hb.pid, "" if hb.ready else ", not ready yet")

    def run(self) -> None:
        self.events.start()
        poller = zmq.Poller()
        poller.register(self.admit, zmq.POLLIN)
        poller.register(self.events.sub, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll(500):
                if sock is self.admit:
                    msg = bus.recv(self.admit)
                    if isinstance(msg, TokenizedRequest):
                        self.place(msg)
                else:
                    got = self.events.recv()
                    if got and isinstance(got[1], Heartbeat):
                        self._log_change(got[1])
                        self.liveness.record(got[1])
                        self.placement.observe(got[1])
            self._place_held()
            self.events.heartbeat(counters={f"placed_replica_{r}": n for r, n in enumerate(self.placed)})


def main() -> None:
    def body(settings: Settings, log) -> None:
        router = Router(settings)
        log.info("bound the bus at %s", settings.bus)
        router.run()

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
