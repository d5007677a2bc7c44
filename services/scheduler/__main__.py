"""`python -m services.scheduler`: one replica's batching loop.

The loop can keep two step plans in flight: while the shard computes step N, step N+1 already waits in its
socket (decode rows feed a placeholder for the token N is sampling: the shard fills it in), so the shard never
waits for the scheduler. When N's tokens come back they are taken in, step N+2 is planned and sent, and only then
are N's tokens published to the detokenizers. The price: a request that arrives during N joins at N+2, a stream
that ends with EOS at N was also fed at N+1 (that token is dropped), and an abort takes effect a step later.
It pays where a step is short next to the round trip it hides (~1-2 ms here): measured on a 2-core CPU with
150 ms steps it gained nothing and cost joining requests a step of TTFT, so by default (--plans-in-flight 0)
the scheduler plans ahead only while steps take under PLAN_AHEAD_BELOW_S, and else plans each step after the
last one's result (and still before publishing it).

When a process dies (issue 7) the scheduler is where requests are saved from, since it holds their tokens:
- a shard restart (its connection drops, or a new ShardReady) requeues the running requests for re-prefill by
  the preemption path (Batcher.requeue_running): nothing is streamed twice;
- a `Resync` (http saw a stall, a detokenizer a gap or an unknown request) is answered with the request's whole
  stream from offset 0 (recovery.StreamLog, kept a while after the end too), or Accepted again while it waits,
  or `Unknown` when this scheduler never saw it (it restarted): http then resubmits the same request;
- a request id seen twice runs once, and one aborted before it arrived never runs (recovery.Forgotten).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import zmq

from libs.protocol import Addresses, topics
from libs.protocol.messages import (
    FINISH_ERROR,
    Abort,
    Accepted,
    RequestError,
    Resync,
    ShardReady,
    StepPlan,
    StepResult,
    StopHit,
    TokenizedRequest,
    Unknown,
)
from libs.runtime import bus, model_store, service
from libs.runtime.settings import Settings
from libs.runtime.timeouts import REPLAY_EVERY
from services.scheduler.batcher import Batcher, Emitted
from services.scheduler.batches import token_batch
from services.scheduler.observe import StepObserver
from services.scheduler.recovery import Forgotten, StreamLog

PLAN_AHEAD_BELOW_S = 0.05  # --plans-in-flight 0: two plans in flight while the last step's forward took less

ROLE = "scheduler"


class SchedulerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.replica = r = settings.index
        addresses = Addresses.parse(settings.bus)
        self.inbox = bus.socket(zmq.PULL, bind=addresses.replica(r, "in"))
        self.plans = bus.socket(zmq.PUB, bind=addresses.replica(r, "plan"))
        self.results = bus.socket(zmq.PULL, bind=addresses.replica(r, "results"))
        self.events = bus.EventBus(addresses, ROLE, r, subscribe=[topics.ctl(r)])
        self.batcher = Batcher(
            settings.num_blocks,
            max_batch_size=settings.max_batch_size,
            max_batch_prefill_tokens=settings.max_batch_prefill_tokens,
            max_waiting_tokens=settings.max_waiting_tokens,
            waiting_served_ratio=settings.waiting_served_ratio,
            eos_ids=set(model_store.model_info(settings.model_path)["eos_token_ids"]),
        )
        self.observer = StepObserver(self.batcher)  # metrics and the per-request spans
        self.ready = False  # shards answered the probe plan
        self.shard_ranks: set[int] = {0}  # shards do not heartbeat: their process_up is ours to report
        self.step = 0
        self.in_flight: deque[StepPlan] = deque()  # plans sent whose results are not in yet, oldest first
        self.step_sent = 0.0  # when the oldest plan in flight became the shards' work (0: none in flight)
        self.last_forward_s = 1.0  # the shard's time for the last step (unknown: plan one at a time)
        self.pending_ctl: list[Abort | StopHit] = []
        self.streams = StreamLog()  # every request's open and rows, for resyncs
        self.forgotten = Forgotten()  # aborted (or ended) ids that must not run again
        self._replayed: dict[str, float] = {}
        # a shard that dies drops its plan subscription: that is how we hear of it before it restarts
        self.shard_watch = self.plans.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        for sock in (self.inbox, self.results, self.events.sub, self.shard_watch):
            self.poller.register(sock, zmq.POLLIN)

    # ---- input handling -------------------------------------------------------------------
    def _take(self, sock: zmq.Socket) -> StepResult | None:
        """Handle one message from `sock`; a StepResult is returned to the caller."""
        if sock is self.events.sub:
            got = self.events.recv()
            if got and isinstance(got[1], (Abort, StopHit)):
                self.pending_ctl.append(got[1])
            elif got and isinstance(got[1], Resync):
                self._resync(got[1])
            return None
        if sock is self.shard_watch:
            sock.recv_multipart()
            self.log.warning("a shard dropped its connection; requeueing the running requests")
            self._shard_lost()
            return None
        msg = bus.recv(sock)
        if isinstance(msg, TokenizedRequest):
            rid = msg.request_id
            if rid in self.forgotten or self.streams.get(rid) is not None:
                self.log.info("dropped an aborted or repeated request", extra={"request_id": rid})
                return None
            if rid not in self.batcher.by_request:
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
            return msg
        return None

    def _probe(self) -> None:
        """Step 0: a shard that hears it drops all sequence state and answers; then we are ready."""
        bus.send(self.plans, StepPlan(step=0))

    def _shard_lost(self) -> None:
        self.ready = False
        # always, also when idle: the prefix index names KV blocks that died with the shard
        self.batcher.requeue_running()

    def _apply_ctl(self) -> None:
        for msg in self.pending_ctl:
            ended = self.batcher.finish(msg.request_id)
            if isinstance(msg, Abort):
                self.forgotten.add(msg.request_id)  # an Abort that overtook its request: it never runs
                if ended is not None:
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
        if batch is not None:
            if now - self._replayed.get(rid, 0.0) < REPLAY_EVERY:
                return
            self._replayed[rid] = now
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

    # ---- output ---------------------------------------------------------------------------
    def _publish(self, rows: list[Emitted]) -> None:
        """One columnar token batch per detokenizer shard."""
        by_detok: dict[int, list[Emitted]] = defaultdict(list)
        self.observer.emitted(rows)
        for row in rows:
            by_detok[row.seq.req.detokenizer].append(row)
        for k, group in by_detok.items():
            batch = token_batch(self.replica, group)
            for o in batch.opens:  # the detokenizer's span continues from ours
                o.traceparent = self.observer.traceparent(o.request_id)
            self.streams.record(batch, group)
            self.events.publish(topics.tok(k), batch)
        self.observer.ended(rows)

    def _fail_running(self, error: str) -> None:
        self.log.error("step failed: %s", error)
        rows = []
        for s in list(self.batcher.running.values()):
            req = s.req
            self.log.error("request failed: %s", error, extra={"request_id": req.request_id})
            message = f"Request failed during generation: Server error: {error}"
            err = RequestError(request_id=req.request_id, message=message, error_type="generation")
            self.events.publish(topics.out(req.ingress), err)
            self.streams.fail(req.request_id, message)
            rows.append(self.batcher.finish(req.request_id, FINISH_ERROR))
        self._publish([r for r in rows if r is not None])

    # ---- the loop -------------------------------------------------------------------------
    def run_step(self) -> bool:
        """Run steps until there is no work: keep one or two plans sent, take each result in as it comes.

        The next step is planned and sent before this step's tokens are published, so publishing (encoding and
        sending the detokenizers' batches) is off the model's critical path too."""
        self._fill()
        if not self.in_flight:
            return False
        while self.in_flight:
            rows = self._await_result()
            if rows is None:  # the shard restarted under the step, or the step failed: the rest is void
                self.in_flight.clear()
                self.batcher.forget_plans()
                return True
            self._apply_ctl()
            self._fill()
            started = time.perf_counter()
            self._publish(rows)
            self.observer.published(time.perf_counter() - started)
        return True

    def _fill(self) -> None:
        """Plan and send steps until enough are out (or there is nothing to plan)."""
        depth = self.settings.plans_in_flight or (2 if self.last_forward_s < PLAN_AHEAD_BELOW_S else 1)
        while len(self.in_flight) < depth and self.ready and self.batcher.has_work():
            self.observer.plan_started()
            plan = self.batcher.plan(self.step + 1)
            if plan is None:
                return
            self.step = plan.step
            self.observer.planned(plan)
            bus.send(self.plans, plan)
            if not self.in_flight:
                self.step_sent = time.monotonic()
            self.in_flight.append(plan)

    def _await_result(self) -> list[Emitted] | None:
        """The oldest plan's tokens, taken in by the batcher; None when it brought none (error or shard loss)."""
        obs = self.observer
        plan = self.in_flight.popleft()
        result, warned = None, False
        while result is None or result.step != plan.step:
            for sock, _ in self.poller.poll(1000):
                got = self._take(sock)
                if got is not None:
                    result = got
            if self.stalled() and not warned:
                warned = True
                self.log.error("step %d: no result from the shards for %.0f s; reporting not ready", plan.step,
                               time.monotonic() - self.step_sent)  # fmt: skip
            self._beat()
            if not self.ready:  # the shard restarted mid-step: its requests are requeued
                self.step_sent = 0.0
                obs.result(plan.step, None)
                self._apply_ctl()
                return None
        self.step_sent = time.monotonic() if self.in_flight else 0.0  # the next plan is the shards' work now
        if warned:
            self.log.info("step %d: the shards answered again", plan.step)
        obs.result(plan.step, result)
        self.last_forward_s = result.forward_s
        if result.error:
            self._fail_running(result.error)
            self._apply_ctl()
            return None
        rows = self.batcher.apply(result)
        obs.applied(plan.step)
        return rows

    def stalled(self) -> bool:
        """A step has been out longer than --shard-stall-timeout: a shard hangs (alive, so no disconnect)."""
        return self.step_sent > 0 and time.monotonic() - self.step_sent > self.settings.shard_stall_timeout

    def _beat(self) -> None:
        """A heartbeat with our load, when one is due (gathering the load reads gauges: not on every wake-up)."""
        if self.events.heartbeat_due():
            self.events.heartbeat(**self.load())

    def load(self) -> dict:
        b = self.batcher
        self.observer.gauges()  # read on the same beat as the heartbeat that carries them
        self.streams.expire()
        for rank in self.shard_ranks:  # shard index as the launcher numbers them: replica-major
            self.observer.shard_up(self.replica * self.settings.num_shard + rank, self.ready)
        return {
            "ready": self.ready and not self.stalled(),
            "queue": len(b.waiting),
            "running": len(b.running),
            "free_blocks": b.allocator.free,
            "total_blocks": b.allocator.num_blocks,
            "counters": b.counters,
        }

    def run(self, log) -> None:
        self.log = log
        self.events.start()
        # say "here, not ready" before probing the shards: a restarted scheduler shows in /health (503) until its
        # shards answered, even when it is back before its old heartbeats go stale
        self._beat()
        while True:
            busy = self.ready and self.batcher.has_work() and self.run_step()
            if not self.ready:  # after our own restart the shard does not knock again: knock ourselves
                self._probe()
            for sock, _ in self.poller.poll(0 if busy else 500):
                self._take(sock)
            self._apply_ctl()
            self._beat()


def main() -> None:
    def body(settings: Settings, log) -> None:
        scheduler = SchedulerService(settings)
        log.info("scheduler for replica %d: %d KV blocks", settings.index, settings.num_blocks)
        scheduler.run(log)

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
