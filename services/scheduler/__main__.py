"""`python -m services.scheduler`: one replica's batching loop.

One turn of the loop runs its phases in order, each a method: receive, control, plan/send, publish, await, apply.
`_receive` is the only place that reads a socket, and the previous step's tokens are published while the shards
compute this one, off the model's critical path. The scheduler holds every request's tokens, so requests are
saved from here when a process dies: a shard restart requeues the running requests for re-prefill
(Batcher.requeue_running), a `Resync` is answered with the stream from offset 0 (recovery.StreamLog), `Accepted`
again or `Unknown`, and a request id runs at most once (recovery.Forgotten). docs/scheduling.md tells the loop,
docs/recovery.md the recovery. SIGTERM drains the replica (drain.py).
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict

import zmq

from libs.protocol import Addresses, topics
from libs.protocol.lora import LoadAdapter, ShardAdaptersAck, UnloadAdapter
from libs.protocol.messages import (
    FINISH_ERROR,
    Abort,
    Accepted,
    RequestError,
    Resync,
    StopHit,
    TokenizedRequest,
    Unknown,
)
from libs.protocol.step_messages import ShardReady, StepPlan, StepResult
from libs.runtime import bus, metrics, model_store, service
from libs.runtime.settings import BLOCK_SIZE, Settings
from libs.runtime.timeouts import REPLAY_EVERY
from services.scheduler.batcher import Batcher, Emitted
from services.scheduler.drain import Drain
from services.scheduler.gateway_metrics import GatewayGauges
from services.scheduler.images import keeps_images_whole
from services.scheduler.lora import LoraControl
from services.scheduler.recovery import Forgotten, StreamLog
from services.scheduler.telemetry import StepObserver
from services.scheduler.token_batch import token_batch

ROLE = "scheduler"
IDLE_POLL_MS = 500  # a receive with nothing to do waits this long (and a shard not ready is probed this often)
AWAIT_POLL_MS = 1000  # a receive while a step runs wakes this often to check for a stall and beat


class SchedulerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.replica = r = settings.index
        addresses = Addresses.parse(settings.bus)
        self.inbox = bus.socket(zmq.PULL, bind=addresses.replica(r, "in"))
        self.announced = reachable(addresses.replica(r, "in"))  # where the router connects, from our heartbeat
        self.plans = bus.socket(zmq.PUB, bind=addresses.replica(r, "plan"))
        self.results = bus.socket(zmq.PULL, bind=addresses.replica(r, "results"))
        self.events = bus.EventBus(addresses, ROLE, r, subscribe=[topics.ctl(r)])
        self.batcher = Batcher(
            settings.num_blocks,
            max_batch_size=settings.max_batch_size,
            max_batch_prefill_tokens=settings.max_batch_prefill_tokens,
            max_prefill_tokens_while_decoding=settings.max_prefill_tokens_while_decoding,
            max_prefill_ms_while_decoding=settings.max_prefill_ms_while_decoding,
            prefill_saturation_tokens=settings.prefill_saturation_tokens,
            eos_ids=set(model_store.model_info(settings.model_path)["eos_token_ids"]),
            speculate=settings.speculate,
            speculate_policy=settings.speculate_policy,
            scheduling_policy=settings.scheduling_policy,
            priority_aging_s=settings.priority_aging_s,
            whole_images=keeps_images_whole(model_store.read_config(settings.model_path)),
        )
        self.observer = StepObserver(self.batcher)  # metrics and the per-request spans
        self.gateway = GatewayGauges(  # the load under vLLM's names, for gateways that route on it
            self.batcher,
            model_name=settings.model_id,
            engine=r,
            max_loras=settings.max_loras,
            block_size=BLOCK_SIZE,
        )
        self.lora = LoraControl(  # LoRA adapters loaded and unloaded while serving
            self.batcher,
            replica=r,
            ranks=settings.num_shard,
            start=dict(e.split("=", 1) for e in settings.lora_adapters.split(",") if e),
            model_id=settings.model_id,
            run_dir=settings.run_dir,
            publish=self.events.publish,
            to_shards=lambda msg: bus.send(self.plans, msg),
        )
        self.ready = False  # shards answered the probe plan
        self.ready_told = False  # `ready` as our last heartbeat said it
        self.idle_told = True  # whether our last heartbeat said we hold no request
        self.shard_ranks: set[int] = {0}  # shards do not heartbeat: their process_up is ours to report
        self.step = 0
        self.step_sent = 0.0  # when the plan in flight was sent (0: none in flight)
        self.result: StepResult | None = None  # the newest result received, until the await phase takes it
        self.unpublished: list[Emitted] | None = None  # the last step's rows, published after the next plan is sent
        self.pending_ctl: list[Abort | StopHit] = []
        self.streams = StreamLog()  # every request's open and rows, for resyncs
        self.forgotten = Forgotten()  # aborted (or ended) ids that must not run again
        self._replayed: dict[str, float] = {}
        # a shard that dies drops its plan subscription: that is how we hear of it before it restarts
        self.shard_watch = self.plans.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.drain = Drain(settings.graceful_termination_timeout)
        self.poller = zmq.Poller()
        for sock in (self.inbox, self.results, self.events.sub, self.shard_watch, self.drain.wake_fd()):
            self.poller.register(sock, zmq.POLLIN)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, log) -> None:
        self.log = log
        self.drain.install()
        self.events.start()
        # say "here, not ready" before probing the shards: a restarted scheduler shows in /health (503) until its
        # shards answered, even when it is back before its old heartbeats go stale
        self._beat()
        while True:
            self.turn()
            holding = len(self.batcher.waiting) + len(self.batcher.running) + bool(self.unpublished)
            outcome = self.drain.outcome(holding)
            if outcome == "drained":
                log.info("drained: every request this replica held has ended; stopping")
                return
            if outcome == "timeout":
                log.warning("drain cut short: %d requests still held at the timeout; handing them back", holding)
                self._hand_back()
                return

    def turn(self) -> None:
        """receive → control → plan/send → publish (the last step's rows) → await → apply."""
        if not self.ready:  # after our own restart the shard does not knock again: knock ourselves
            self._probe()
        busy = self.unpublished is not None or (self.ready and self.batcher.has_work())
        self._receive(0 if busy else IDLE_POLL_MS)
        self._control()
        self.lora.tick()  # an unload whose last request ended goes to the shards
        plan = self._plan_and_send() if self.ready else None
        self._publish_unpublished()
        if plan is not None:
            result = self._await(plan)
            if result is not None:
                self.unpublished = self._apply(plan, result)
        self._beat()

    # ---- receive --------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> None:
        """Take in every message that arrives within `timeout_ms` (or is already there)."""
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is self.events.sub:
                self._on_event()
            elif sock == self.drain.wake_fd():  # a signal: SIGTERM's drain is announced by the next beat
                self.drain.woken()
            elif sock is self.shard_watch:
                sock.recv_multipart()
                self.log.warning("a shard dropped its connection; requeueing the running requests")
                self._shard_lost()
            else:
                self._on_message(bus.recv(sock))

    def _on_event(self) -> None:
        got = self.events.recv()
        if got and isinstance(got[1], (Abort, StopHit)):
            self.pending_ctl.append(got[1])
        elif got and isinstance(got[1], Resync):
            self._resync(got[1])
        elif got and isinstance(got[1], (LoadAdapter, UnloadAdapter)):
            self.lora.request(got[1])

    def _on_message(self, msg) -> None:
        """A placed request (inbox), or a shard's ShardReady or StepResult (results)."""
        if isinstance(msg, TokenizedRequest):
            rid = msg.request_id
            if rid in self.forgotten or self.streams.get(rid) is not None:
                self.log.info("dropped an aborted or repeated request", extra={"request_id": rid})
                return
            new = rid not in self.batcher.by_request
            if not self.lora.admits(msg, new):
                return
            if new:
                self.observer.arrived(msg)
            self.batcher.add(msg)
        elif isinstance(msg, ShardReady):
            # a (re)started shard holds no KV: what was running is fed again (re-prefill)
            self.log.info("shard %d ready (pid %d); probing", msg.rank, msg.pid)
            self.shard_ranks.add(msg.rank)
            self._shard_lost()
            self._probe()
        elif isinstance(msg, StepResult):
            if msg.step == 0 and not self.ready:
                self.ready = True
                self.log.info("shards ready")
            self.result = msg
        elif isinstance(msg, ShardAdaptersAck):
            self.lora.ack(msg)

    def _probe(self) -> None:
        """Step 0: a shard that hears it drops all sequence state and answers; then we are ready."""
        bus.send(self.plans, StepPlan(step=0))
        self.lora.resend()  # after the probe, in order: a restarted shard reloads the run-time adapters

    def _shard_lost(self) -> None:
        self.ready = False
        # always, also when idle: the prefix index names KV blocks that died with the shard
        self.batcher.requeue_running()

    # ---- control --------------------------------------------------------------------------
    def _control(self) -> None:
        """Aborts and stop-sequence hits received since the last turn end their requests."""
        for msg in self.pending_ctl:
            ended = self.batcher.finish(msg.request_id)
            if isinstance(msg, Abort):
                self.forgotten.add(msg.request_id)  # an Abort that overtook its request: it never runs
                if ended is not None and self.unpublished is not None:
                    self.unpublished.append(ended)  # behind the last step's rows: an end must not overtake them
                elif ended is not None:
                    self._publish([ended])
            else:  # a stop sequence: the detokenizer ended the stream
                self.streams.end(msg.request_id)
        self.pending_ctl.clear()

    def _resync(self, msg: Resync) -> None:
        """Re-send a request's stream from offset 0, or say it waits, or that we do not know it."""
        rid, now = msg.request_id, time.monotonic()
        st = self.streams.get(rid)
        s = self.batcher.by_request.get(rid)
        if st is not None and st.error is not None:
            if msg.ingress >= 0:
                err = RequestError(request_id=rid, message=st.error, error_type="generation")
                self.events.publish(topics.out(msg.ingress), err)
            return
        batch = self.streams.replay(self.replica, rid)
        if batch is not None and s is not None and st.rows[-1].offset < msg.delivered:
            batch = None  # live, and http has every row published: slow (a busy machine), not lost: Accepted
        if batch is not None:
            if now - self._replayed.get(rid, 0.0) < REPLAY_EVERY:
                return
            self._replayed[rid] = now
            if msg.ingress >= 0:  # http's (a detokenizer counts its own)
                metrics.get().resyncs.labels(by="http", reason="replayed").inc()
            if len(self._replayed) > 10_000:
                self._replayed = {k: t for k, t in self._replayed.items() if now - t < REPLAY_EVERY}
            self.log.info("resync: replaying %d rows", len(batch.request_ids), extra={"request_id": rid})
            self.events.publish(topics.tok(st.rows[0].seq.req.detokenizer), batch)
        elif s is not None:  # waiting, or prefilling: nothing streamed yet; tell http it is alive
            if msg.ingress >= 0:
                req = s.req
                accepted = Accepted(
                    request_id=rid,
                    replica=self.replica,
                    input_length=len(req.input_ids),
                    max_new_tokens=req.max_new_tokens,
                )
                self.events.publish(topics.out(msg.ingress), accepted)
        elif msg.ingress >= 0 and rid not in self.forgotten:
            self.events.publish(topics.out(msg.ingress), Unknown(request_id=rid))

    # ---- plan/send ------------------------------------------------------------------------
    def _plan_and_send(self) -> StepPlan | None:
        """The next step's plan, sent to the shards; None when there is nothing to run."""
        if not self.batcher.has_work():
            return None
        self.observer.plan_started()
        plan = self.batcher.plan(self.step + 1)
        if plan is None:
            return None
        self.step = plan.step
        self.observer.planned(plan)
        self.result = None
        bus.send(self.plans, plan)
        self.step_sent = time.monotonic()
        return plan

    # ---- publish --------------------------------------------------------------------------
    def _publish_unpublished(self) -> None:
        """The last applied step's rows, sent while the shards compute the next step."""
        if self.unpublished is None:
            return
        rows, self.unpublished = self.unpublished, None
        started = time.perf_counter()
        self._publish(rows)
        self.observer.published(time.perf_counter() - started)

    def _publish(self, rows: list[Emitted]) -> None:
        """One columnar token batch per detokenizer shard."""
        by_detok: dict[int, list[Emitted]] = defaultdict(list)
        self.observer.emitted(rows)
        self.lora.emitted(rows)
        for row in rows:
            by_detok[row.seq.req.detokenizer].append(row)
        for k, group in by_detok.items():
            batch = token_batch(self.replica, group)
            for o in batch.opens:  # the detokenizer's span continues from ours
                o.traceparent = self.observer.traceparent(o.request_id)
            self.streams.record(batch, group)
            self.events.publish(topics.tok(k), batch)
        self.observer.ended(rows)

    # ---- await ----------------------------------------------------------------------------
    def _await(self, plan: StepPlan) -> StepResult | None:
        """Receive until the plan's result is in; None when the shards restarted under the step."""
        warned = False
        while self.result is None or self.result.step != plan.step:
            self._receive(AWAIT_POLL_MS)
            if self.stalled() and not warned:
                warned = True
                self.log.error("step %d: no result from the shards for %.0f s; reporting not ready", plan.step,
                               time.monotonic() - self.step_sent)  # fmt: skip
            self._beat()
            if not self.ready:  # the shard restarted mid-step: its requests are requeued
                self.step_sent = 0.0
                self.observer.result(plan.step, None)
                self.batcher.forget_plans()
                return None
        if warned:
            self.log.info("step %d: the shards answered again", plan.step)
        result, self.result, self.step_sent = self.result, None, 0.0
        return result

    def stalled(self) -> bool:
        """A step has been out longer than --shard-stall-timeout: a shard hangs (alive, so no disconnect)."""
        return self.step_sent > 0 and time.monotonic() - self.step_sent > self.settings.shard_stall_timeout

    # ---- apply ----------------------------------------------------------------------------
    def _apply(self, plan: StepPlan, result: StepResult) -> list[Emitted] | None:
        """The batcher takes the step's tokens in; None when the step failed (its requests fail with it)."""
        self.observer.result(plan.step, result)
        if result.error:
            self._fail_running(result.error)
            self.batcher.forget_plans()
            return None
        if result.errors:
            self._fail_rows(result.errors)
        rows = self.batcher.apply(result)
        self.observer.applied(plan.step)
        return rows

    def _fail_rows(self, errors: dict[int, str]) -> None:
        """Rows that failed alone on the shard, each with what failed (its grammar: no token fits; its images: the
        encoder cannot read them as sent): those requests fail (TGI's generation error, 424) and free their blocks
        (none is indexed in the prefix cache); the step's other rows go on."""
        rows, failed = [], []
        for seq, error in errors.items():
            s = self.batcher.running.get(seq)
            if s is None:
                continue  # ended (aborted) while the step ran
            req = s.req
            message = f"Request failed during generation: {error}"
            self.log.error("request failed: %s", message, extra={"request_id": req.request_id})
            err = RequestError(request_id=req.request_id, message=message, error_type="generation")
            self.events.publish(topics.out(req.ingress), err)
            failed.append((req.request_id, message))
            rows.append(self.batcher.finish(req.request_id, FINISH_ERROR))
        self._publish_failed(rows, failed)

    def _publish_failed(self, rows: list, failed: list[tuple[str, str]]) -> None:
        """Publish the failed rows, then mark their streams failed: a request failing at its first step has no
        stream before `_publish` opens it, and the error must be in the stream log for a resync to replay it."""
        self._publish([r for r in rows if r is not None])
        for request_id, message in failed:
            self.streams.fail(request_id, message)

    def _fail_running(self, error: str) -> None:
        self.log.error("step failed: %s", error)
        rows, failed = [], []
        for s in list(self.batcher.running.values()):
            req = s.req
            self.log.error("request failed: %s", error, extra={"request_id": req.request_id})
            message = f"Request failed during generation: Server error: {error}"
            err = RequestError(request_id=req.request_id, message=message, error_type="generation")
            self.events.publish(topics.out(req.ingress), err)
            failed.append((req.request_id, message))
            rows.append(self.batcher.finish(req.request_id, FINISH_ERROR))
        self._publish_failed(rows, failed)

    def _hand_back(self) -> None:
        """A drain past its timeout: every request held is answered `Unknown`, as a restarted scheduler would, so
        http resubmits it at once (the router places it on another replica, not on this draining one) and drops
        the rows it already delivered."""
        for s in [*self.batcher.waiting, *self.batcher.running.values()]:
            self.events.publish(topics.out(s.req.ingress), Unknown(request_id=s.req.request_id))

    # ---- heartbeat ------------------------------------------------------------------------
    def _beat(self) -> None:
        """When a heartbeat is due: refresh the gauges it goes with, expire ended streams, send our load. A drain
        that began, the shards' readiness when it changed, and the end of the last request held are announced at
        once, out of turn: the router must stop placing here now, or may start to (a server is healthy as soon as
        its router hears it), or would go on counting ended requests as our load for up to a beat and send a
        burst that comes meanwhile to the other replicas."""
        draining = self.drain.active and self.drain.announced is None
        held = len(self.batcher.waiting) + len(self.batcher.running)
        if draining:
            self.log.info("SIGTERM: draining (%d requests held, up to %gs)", held, self.drain.timeout)
        if draining or self.ready != self.ready_told or (held == 0 and not self.idle_told):
            self.events.publish(self.events.hb_topic, self.events.heartbeat_message(**self.load()))
            self.ready_told, self.idle_told = self.ready, held == 0
            if draining:
                self.drain.beat_sent()
        if not self.events.heartbeat_due():
            return
        self.observer.gauges()
        self.gateway.update()
        self.streams.expire()
        for rank in self.shard_ranks:  # shard index as the launcher numbers them: replica-major
            self.observer.shard_up(self.replica * self.settings.num_shard + rank, self.ready)
        self.events.heartbeat(**self.load())
        self.ready_told, self.idle_told = self.ready, held == 0
        self.lora.announce()  # a restarted http or tokenizer learns the current adapters within a beat

    def load(self) -> dict:
        """What our heartbeat carries (reads state only)."""
        b = self.batcher
        return {
            "ready": self.ready and not self.stalled(),
            "queue": len(b.waiting),
            "running": len(b.running),
            "free_blocks": b.allocator.free,
            "total_blocks": b.allocator.num_blocks,
            "counters": b.counters,
            "address": self.announced,
            "model": self.settings.model_id,
            "adapters": list(self.lora.accepting),
            "max_batch": self.settings.max_batch_size,
            "draining": self.drain.active,
        }


def reachable(bound: str) -> str:
    """The address a peer connects to for one we bound: a wildcard host (all interfaces) becomes this host's
    name (in a StatefulSet, the pod's stable DNS name under its headless service)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if bound.startswith(wildcard):
            return f"tcp://{socket.getfqdn()}:{bound[len(wildcard) :]}"
    return bound


def main() -> None:
    def body(settings: Settings, log) -> None:
        scheduler = SchedulerService(settings)
        log.info("scheduler for replica %d: %d KV blocks", settings.index, settings.num_blocks)
        scheduler.run(log)

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
