"""`python -m services.router`: bind the bus, proxy events, place requests.

What the router keeps and does across restarts, its own and its peers', is told in docs/recovery.md: placement
is sticky per request id (a resubmitted request goes where it went), and a request that needs a detokenizer or
a scheduler while that role is awaited (Liveness.awaited: lost less than RESTART_WAIT_S ago, or never heard by
a router that has just started) is held until one is heard, then placed in arrival order. A request whose model's
every live replica is draining is held too, until one is not (replica_wait.py).
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
from libs.runtime.liveness import Liveness, serving
from libs.runtime.settings import Settings
from libs.runtime.timeouts import VIEW_STALL_S
from services.router.placement import Placement
from services.router.replica_wait import WAIT_S, ReplicaWait

ROLE = "router"

NEEDS = ("detokenizer", "scheduler")  # the roles a request is placed on
NO_DETOK = "No detokenizer is available"
log = logging.getLogger("switchyard.router")


def all_draining(schedulers: list[Heartbeat]) -> bool:
    """Whether there are live replicas and every one of them is draining (nothing new may go to any)."""
    return bool(schedulers) and all(hb.draining for hb in schedulers)


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
        # replica index → PUSH to its scheduler's intake, created from the replica's first announcement (its
        # heartbeat's address); the configured replicas are a seed, connected before anything is heard
        self.replicas: dict[int, zmq.Socket] = {}
        self.replica_address: dict[int, str] = {}
        self.placed: dict[int, int] = {}  # requests placed, by replica
        for r in range(max(1, settings.replicas)):
            self._connect_replica(r, addresses.replica(r, "in"), seed=True)
        self.events = bus.EventBus(addresses, ROLE, settings.index, subscribe=[topics.HB])
        self.liveness = Liveness()
        self.placement = Placement()
        self._states: dict[
            tuple[str, int], tuple[int, bool, bool]
        ] = {}  # (role, index) → (pid, ready, draining) last seen
        self._claimants: set[tuple[str, int, str]] = set()  # runs refused for a live process's identity, logged
        self._placed_ids: OrderedDict[str, tuple[int, int]] = OrderedDict()  # request id → (replica, detokenizer)
        # waiting for a role it needs (_awaited), by request id in arrival order → (request, since when)
        self.held: OrderedDict[str, tuple[TokenizedRequest, float]] = OrderedDict()
        self.replica_wait = ReplicaWait()  # waiting for a replica of its model that is not draining

    def _connect_replica(self, r: int, address: str, seed: bool = False) -> None:
        """Our PUSH to replica r at `address`: a new one, or the seed moved to where the replica says it is."""
        before = self.replica_address.get(r)
        if before == address:
            return
        if before is None:
            self.replicas[r] = bus.socket(zmq.PUSH, connect=address)
        else:
            self.replicas[r].disconnect(before)
            self.replicas[r].connect(address)
        self.replica_address[r] = address
        self.placed.setdefault(r, 0)
        if not seed:
            log.info("replica %d joins at %s", r, address)

    def _awaited(self) -> list[str]:
        """The roles a request needs that are restarting (Liveness.awaited): while any is, requests wait."""
        return [role for role in NEEDS if self.liveness.awaited(role)]

    def _hold(self, req: TokenizedRequest, awaited: list[str]) -> None:
        if req.request_id in self.held:  # a resubmission of a request already waiting
            return
        self.held[req.request_id] = (req, time.monotonic())
        log.info(
            "no live %s yet: the request waits for one", " or ".join(awaited), extra={"request_id": req.request_id}
        )

    def _place_held(self) -> None:
        """Place what waits once nothing it needs is awaited any more: a process was heard, or RESTART_WAIT_S
        passed (then placing fails as it would have at once, "No detokenizer is available")."""
        if self.held and not self._awaited():
            held, self.held = self.held, OrderedDict()
            now = time.monotonic()
            log.info(
                "placing %d held requests (waited up to %.1f s)", len(held), now - min(t for _, t in held.values())
            )
            for req, _ in held.values():
                self.place(req)

    def _joined(self, model: str) -> list[Heartbeat]:
        """The live replicas of `model` that the router has a socket to."""
        return [hb for hb in self._of_model("scheduler", model) if hb.index in self.replicas]

    def _all_draining(self, model: str) -> bool:
        return all_draining(self._joined(model))

    def _place_waiting(self) -> None:
        """Place the requests that waited for a replica that is not draining once their model has one (or no
        longer has only draining ones); fail those that waited WAIT_S."""
        if not self.replica_wait:
            return
        place, fail = self.replica_wait.release(self._all_draining, time.monotonic())
        for req in fail:
            model = f"`{req.model or self.settings.model_id}`"
            self._fail(req, f"No replica of model {model} is available: every one is draining")
        for req in place:
            log.info("a replica of its model takes new requests: placing it", extra={"request_id": req.request_id})
            self.place(req)

    def _fail(self, req: TokenizedRequest, message: str) -> None:
        log.warning("cannot place request: %s", message, extra={"request_id": req.request_id})
        error = RequestError(request_id=req.request_id, message=message, error_type="unavailable")
        self.events.publish(topics.out(req.ingress), error)

    def place(self, req: TokenizedRequest) -> None:
        """Place one request, in the router's span (a child of the tokenizer's)."""
        awaited = self._awaited()
        if awaited:
            return self._hold(req, awaited)
        self._place_held()  # those that came first go first
        self._place_waiting()
        started = time.perf_counter()
        with tracing.span("router", req.traceparent, request_id=req.request_id) as sp:
            req.traceparent = tracing.traceparent_of(sp) or req.traceparent
            self._place(req)
            if sp.is_recording():
                sp.set_attributes({"replica": req.replica, "detokenizer": req.detokenizer})
        m = metrics.get()
        if m is not None:
            m.hop_duration.labels(hop="router").observe(time.perf_counter() - started)

    def _of_model(self, role: str, model: str) -> list[Heartbeat]:
        """The live processes of `role` that serve `model` ("": the default, this router's own); one that names no
        model serves the default, and so does every one for a router that names none (started without one)."""
        return self.liveness.alive(role, serving(model, self.settings.model_id))

    def _place(self, req: TokenizedRequest) -> None:
        # only the request's model's processes; sticky per request: the whole stream goes through one detokenizer
        detokenizers = self._of_model("detokenizer", req.model)
        schedulers = self._joined(req.model)
        named = req.model and req.model != self.settings.model_id
        if named and not schedulers:  # the default model's request waits for a replica instead (choose_replica)
            return self._fail(req, f"No replica of model `{req.model}` is available")
        before = self._placed_ids.get(req.request_id)
        if (
            before is not None
            and before[0] in {hb.index for hb in schedulers}
            and before[1] in {hb.index for hb in detokenizers}
        ):
            replica, detokenizer = before
        elif all_draining(schedulers):
            if self.replica_wait.hold(req, time.monotonic()):
                log.info(
                    "every replica of its model is draining: the request waits for one (up to %g s)",
                    WAIT_S,
                    extra={"request_id": req.request_id},
                )
            return
        else:
            self.replica_wait.forget(req.request_id)  # a resubmission of one that waited: placed now, once
            detokenizer = self.placement.choose_detokenizer(detokenizers)
            if detokenizer is None:
                return self._fail(req, f"No detokenizer of model `{req.model}` is available" if named else NO_DETOK)
            replica = self.placement.choose_replica(req.input_ids, schedulers, req.adapter, req.group, req.images)
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
        key, state = (hb.role, hb.index), (hb.pid, hb.ready, hb.draining)
        if self._states.get(key) != state:
            self._states[key] = state
            how = ", draining: nothing new is placed on it" if hb.draining else "" if hb.ready else ", not ready yet"
            log.info("%s.%d is up (pid %d)%s", hb.role, hb.index, hb.pid, how)

    def _log_claimant(self, hb: Heartbeat) -> None:
        """A second run claiming a live process's role and index (Liveness.record): said once per run, loudly."""
        key = (hb.role, hb.index, hb.instance)
        if key not in self._claimants:
            self._claimants.add(key)
            log.error(
                "a second process claims %s.%d (pid %d, run %s) while the one heard first still beats: it is "
                "refused and gets no work (give it another index, or stop one of them)",
                hb.role,
                hb.index,
                hb.pid,
                hb.instance,
            )

    def _read_heartbeats(self, most: int = 10_000) -> None:
        """Every heartbeat that waits, before any request is placed: a router that was starved or stopped for a
        heartbeat lifetime would otherwise judge a live peer gone on a view it has not read yet, and fail the
        request with "No detokenizer is available" (seen after SIGSTOP/SIGCONT of the router)."""
        for _ in range(most):
            if not self.events.sub.poll(0):
                return
            got = self.events.recv()
            if got and isinstance(got[1], Heartbeat):
                self.heard(got[1])

    def heard(self, hb: Heartbeat) -> None:
        """One heartbeat into the view; a scheduler's joins its replica (connects our PUSH to its address)."""
        if not self.liveness.record(hb):
            return self._log_claimant(hb)
        if hb.role == "scheduler" and hb.address:
            self._connect_replica(hb.index, hb.address)
        self._log_change(hb)
        self.placement.observe(hb)

    def run(self) -> None:
        self.events.start()
        poller = zmq.Poller()
        poller.register(self.admit, zmq.POLLIN)
        poller.register(self.events.sub, zmq.POLLIN)
        last_turn = time.monotonic()
        while True:
            ready = dict(poller.poll(500))
            now = time.monotonic()
            if now - last_turn > VIEW_STALL_S:  # starved or stopped: the heartbeats we hold are old news
                log.info("the router's loop stalled %.1f s: its view of the processes starts over", now - last_turn)
                self.liveness.resume()
            last_turn = now
            if self.events.sub in ready:
                self._read_heartbeats()
            if self.admit in ready:
                msg = bus.recv(self.admit)
                if isinstance(msg, TokenizedRequest):
                    self.place(msg)
            self._place_held()
            self._place_waiting()
            # its model is the default one: a tokenizer of that model takes requests from intake (tokenizer's join)
            counters = {f"placed_replica_{r}": n for r, n in self.placed.items()}
            self.events.heartbeat(counters=counters, model=self.settings.model_id)


def main() -> None:
    def body(settings: Settings, log) -> None:
        router = Router(settings)
        log.info("bound the bus at %s", settings.bus)
        router.run()

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
