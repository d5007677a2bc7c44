"""What the scheduler records: TGI's queue and batch metrics, Switchyard's step phases and KV use, and the
per-request spans of the scheduler's hops (queue, prefill, decode).

The loop in `__main__` tells a `StepObserver` what happens; it reads the Batcher's public state only
(waiting, running, allocator, counters), so it is tested without sockets. Spans are kept only while
tracing is on: with it off, nothing per request is stored.

Span tree under the router's span (from TokenizedRequest.traceparent): `scheduler_queue` (arrival to
first scheduled), `prefill` (scheduled to first token; several steps with chunked prefill), `decode`
(first token to the end). The detokenizer's span continues from `decode` (or from `prefill` when the
first token was also the last): `traceparent(request_id)` gives it for the StreamOpen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.trace import Status, StatusCode

from libs.protocol.messages import FINISH_ERROR, FINISH_NAMES, TokenizedRequest
from libs.protocol.step_messages import StepPlan, StepResult
from libs.runtime import metrics, tracing

PREFIX_COUNTERS = (  # (the batcher's counter, the Prometheus counter it feeds)
    ("prefix_queried_tokens", "prefix_cache_queried_tokens"),
    ("prefix_hit_tokens", "prefix_cache_hit_tokens"),
    ("draft_tokens", "speculative_draft_tokens"),
    ("accepted_tokens", "speculative_accepted_tokens"),
)


@dataclass
class _Spans:
    parent: str | None  # the router span's traceparent
    queue: object = None
    prefill: object = None
    decode: object = None
    last: str | None = None  # traceparent of the newest of them, for the detokenizer


class StepObserver:
    def __init__(self, batcher):
        self.batcher = batcher
        self.m = metrics.get()
        if self.m is None:
            raise RuntimeError("metrics.init() comes first (service.run does it)")
        self.arrived_at: dict[str, float] = {}  # request id → when it reached the queue (monotonic)
        self.spans: dict[str, _Spans] = {}
        # per step in flight: (method, when its planning started, when it was sent)
        self._steps: dict[int, tuple[str, float, float]] = {}
        self._t_plan = self._t_result = 0.0
        self._prefix_seen = {name: 0 for name, _ in PREFIX_COUNTERS}

    # ---- requests -------------------------------------------------------------------------
    def arrived(self, req: TokenizedRequest) -> None:
        self.arrived_at[req.request_id] = time.monotonic()
        if tracing.enabled():
            sp = _Spans(req.traceparent)
            sp.queue = tracing.start("scheduler_queue", req.traceparent, request_id=req.request_id)
            self.spans[req.request_id] = sp

    def _scheduled(self, rid: str, now: float) -> None:
        t = self.arrived_at.pop(rid, None)
        if t is not None:
            self.m.hop_duration.labels(hop="scheduler_queue").observe(now - t)
        sp = self.spans.get(rid)
        if sp is not None and sp.queue is not None:  # a preempted request rescheduled keeps its spans
            sp.queue.end()
            sp.queue = None
            sp.prefill = tracing.start("prefill", sp.parent, request_id=rid)
            sp.last = tracing.traceparent_of(sp.prefill)

    # ---- one step -------------------------------------------------------------------------
    def plan_started(self) -> None:
        self._t_plan = time.perf_counter()

    def planned(self, plan: StepPlan) -> None:
        """The plan is built (and about to be sent)."""
        sent = time.perf_counter()
        prefill = bool(plan.new) or bool(len(plan.num_tokens) and int(plan.num_tokens.max()) > 1)
        method = "prefill" if prefill else "decode"  # TGI's batches are one or the other
        self._steps[plan.step] = (method, self._t_plan, sent)
        now = time.monotonic()
        for new in plan.new:
            s = self.batcher.running.get(new.seq)
            if s is not None:
                self._scheduled(s.req.request_id, now)
        m = self.m
        m.step_duration.labels(phase="plan").observe(sent - self._t_plan)
        m.batch_inference_count.labels(method=method).inc()
        m.constrained_rows.observe(self.batcher.step_constrained)
        if plan.new:
            m.batch_next_size.observe(len(plan.new))

    def result(self, step: int, result: StepResult | None) -> None:
        """The step's result came back (None: the shard restarted under it). Its "forward" phase runs from when
        the shard could start it (sent, or the previous step's result, whichever is later) to now."""
        method, _, sent = self._steps.get(step, ("decode", 0.0, 0.0))
        now = time.perf_counter()
        started, self._t_result = max(sent, self._t_result), now
        if result is None or result.error:  # a failed or lost step is never applied: drop its timing
            self._steps.clear()
        m = self.m
        m.step_duration.labels(phase="forward").observe(now - started)
        if result is None or result.error:
            m.batch_inference_failure.labels(method=method).inc()
        else:
            m.batch_forward_duration.labels(method=method).observe(result.forward_s)
            if result.encode_s:
                m.image_encode_duration.observe(result.encode_s)

    def applied(self, step: int) -> None:
        """The sampled tokens are taken in (stops, bookkeeping): the scheduler's side of sampling; the step
        succeeded. Called before the next step is planned (the loop plans it before publishing this one)."""
        method, t_plan, _ = self._steps.pop(step, ("decode", 0.0, 0.0))
        m, now = self.m, time.perf_counter()
        m.step_duration.labels(phase="sample").observe(now - self._t_result)
        for accepted in self.batcher.step_accepted:  # TGI: per generation with speculation, its tokens − 1
            m.request_skipped_tokens.observe(accepted)
        m.batch_inference_success.labels(method=method).inc()
        m.batch_inference_duration.labels(method=method).observe(now - t_plan)

    def published(self, seconds: float) -> None:
        """A step's tokens went out to the detokenizers (while the next step already runs on the shard)."""
        self.m.step_duration.labels(phase="publish").observe(seconds)

    # ---- rows going out -------------------------------------------------------------------
    def emitted(self, rows) -> None:
        """Rows about to be published: a first token ends the prefill span and starts the decode span."""
        if not self.spans:
            return
        for row in rows:
            sp = self.spans.get(row.seq.req.request_id)
            if sp is not None and row.token_id >= 0 and row.offset == 0 and sp.prefill is not None:
                sp.prefill.end()
                sp.prefill = None
                if not row.finish:
                    sp.decode = tracing.start("decode", sp.parent, request_id=row.seq.req.request_id)
                    sp.last = tracing.traceparent_of(sp.decode)

    def traceparent(self, request_id: str) -> str | None:
        """For the request's StreamOpen: the span the detokenizer's continues (None with tracing off)."""
        sp = self.spans.get(request_id)
        return sp.last if sp is not None else None

    def ended(self, rows) -> None:
        """Rows published: an end row ends the request's spans (after its StreamOpen took their context)."""
        for row in rows:
            if not row.finish:
                continue
            rid = row.seq.req.request_id
            self.arrived_at.pop(rid, None)  # ended while still waiting
            sp = self.spans.pop(rid, None)
            if sp is None:
                continue
            for span in (sp.queue, sp.prefill, sp.decode):
                if span is None:
                    continue
                if row.finish == FINISH_ERROR:
                    span.set_status(Status(StatusCode.ERROR, "the step failed"))
                span.set_attributes(
                    {"finish": FINISH_NAMES.get(row.finish, "error"), "generated_tokens": len(row.seq.output)}
                )
                span.end()

    # ---- gauges ---------------------------------------------------------------------------
    def shard_up(self, index: int, up: bool) -> None:
        """switchyard_process_up of a shard, which has no heartbeat of its own: up while it answers plans."""
        self.m.process_up.labels(role="shard", index=str(index)).set(1 if up else 0)

    def gauges(self) -> None:
        """TGI's queue/batch gauges and the KV blocks, from the batcher's state (once per loop turn)."""
        m, b = self.m, self.batcher
        m.queue_size.set(len(b.waiting))
        m.hop_queue_depth.labels(hop="scheduler").set(len(b.waiting))
        m.batch_current_size.set(len(b.running))
        # TGI's CachedBatch.max_tokens: the tokens the running batch may reach
        m.batch_current_max_tokens.set(sum(s.prompt_len + s.req.max_new_tokens for s in b.running.values()))
        free = b.allocator.free
        m.kv_blocks_free.set(free)
        m.kv_blocks_used.set(b.allocator.num_blocks - free)
        for name, metric in PREFIX_COUNTERS:  # the batcher's prefix-cache and draft counters, as Prometheus counters
            now = b.counters[name]
            if now > self._prefix_seen[name]:
                getattr(m, metric).inc(now - self._prefix_seen[name])
                self._prefix_seen[name] = now
