"""What the http process reports: each generation's TGI request metrics, http span and log line
(`RequestRecord`), and on /metrics what the heartbeats say of every process (`legacy_text`).

`Ingress.generate` (the one path every TGI/OpenAI generation takes) opens a `RequestRecord` and tells it
what it sees: accepted, each row, the end (success, failure, or the client gone). The phase split is the
one of the x-*-time headers (services.http.timing): validation = read → accepted, queue = accepted → first
row (queueing and prefill), inference = first row → last row.
"""

from __future__ import annotations

import logging
import time

from opentelemetry.trace import Status, StatusCode

from libs.protocol.messages import FinalInfo, GenerateRequest, Heartbeat
from libs.runtime import metrics, tracing
from libs.runtime.liveness import Liveness
from services.http.timing import Timing

log = logging.getLogger("switchyard.http")

# TGI's `err` label of tgi_request_failure for each error_type (TGI counts its three template errors as
# "template" and IncompleteGeneration as "incomplete"); "dropped" is a client that went away.
ERR_LABEL = {
    "validation": "validation",
    "overloaded": "overloaded",
    "generation": "generation",
    "incomplete_generation": "incomplete",
    "incomplete_generation_stream": "incomplete",
    "template_error": "template",
    "missing_template_variable": "template",
    "tool_error": "template",
}


def err_label(error_type: str) -> str:
    """TGI's label, or our own error_type where TGI has none (e.g. "unavailable": no tokenizer alive)."""
    return ERR_LABEL.get(error_type, error_type)


def count_overloaded(n: int = 1) -> None:
    """A 429 from the concurrency limit: TGI counts it as a request and as a failure{err="overloaded"}."""
    m = metrics.get()
    if m is not None:
        m.request_count.inc(n)
        m.request_failure.labels(err="overloaded").inc(n)


class RequestRecord:
    """One generation's metrics, span and log line; `timing` is the Timing the request fills in."""

    def __init__(self, req: GenerateRequest, timing: Timing, *, quiet: bool = False):
        self.rid = req.request_id
        self.timing = timing
        # quiet: a secondary sequence of best_of, which TGI does not count as a request of its own
        self.m = None if quiet else metrics.get()
        self.span = tracing.start("http", req.traceparent, request_id=req.request_id, stream=req.stream)
        # the tokenizer's span continues from ours (or, with tracing off, from the client's own traceparent)
        req.traceparent = tracing.traceparent_of(self.span) or req.traceparent
        self.prev: float | None = None
        self.ended = False
        if self.m is not None:
            self.m.request_count.inc()

    def accepted(self, input_length: int, max_new_tokens: int) -> None:
        if self.m is not None:
            self.m.request_input_length.observe(input_length)
            if max_new_tokens > 0:
                self.m.request_max_new_tokens.observe(max_new_tokens)

    def row(self, now: float) -> None:
        if self.m is not None:
            if self.prev is None:
                self.m.time_to_first_token.observe(now - self.timing.start)
            else:
                self.m.inter_token_latency.observe(now - self.prev)
        self.prev = now

    def success(self, final: FinalInfo) -> None:
        self.ended = True
        t, end = self.timing, time.monotonic()
        accepted = t.accepted or end
        first = t.first or accepted
        last = t.last or end
        validation, queue, inference = accepted - t.start, first - accepted, max(last - first, 0.0)
        per_token = inference / max(final.generated_tokens, 1)
        if self.m is not None:
            m = self.m
            m.request_success.inc()
            m.request_duration.observe(end - t.start)
            m.request_validation_duration.observe(validation)
            m.request_queue_duration.observe(queue)
            m.request_inference_duration.observe(inference)
            m.request_mean_time_per_token_duration.observe(per_token)
            m.request_generated_tokens.observe(final.generated_tokens)
        if self.span.is_recording():
            self.span.set_attributes({"generated_tokens": final.generated_tokens, "finish_reason": final.finish_reason})
        self.span.end()
        # TGI logs every successful request at INFO with its timings
        log.info(
            "Success: %d tokens (%s) in %.3fs: validation %.3fs, queue %.3fs, inference %.3fs, %.4fs/token",
            final.generated_tokens,
            final.finish_reason,
            end - t.start,
            validation,
            queue,
            inference,
            per_token,
            extra={"request_id": self.rid},
        )

    def failure(self, message: str, error_type: str) -> None:
        self.ended = True
        if self.m is not None:
            self.m.request_failure.labels(err=err_label(error_type)).inc()
        if self.span.is_recording():
            self.span.set_status(Status(StatusCode.ERROR, message))
            self.span.set_attribute("error_type", error_type)
        self.span.end()
        log.warning("request failed (%s): %s", error_type, message, extra={"request_id": self.rid})

    def dropped(self) -> None:
        """The client went away before the end (TGI's err="dropped")."""
        if self.ended:
            return
        self.ended = True
        if self.m is not None:
            self.m.request_failure.labels(err="dropped").inc()
        if self.span.is_recording():
            self.span.set_attribute("dropped", True)
        self.span.end()
        log.info("client went away; request aborted", extra={"request_id": self.rid})


def legacy_text(liveness: Liveness) -> str:
    """What heartbeats say besides the registries: each process's own counters
    (switchyard_<role>_<name>_total{index}) and each replica's load (switchyard_replica_*{replica}),
    integers, under names no registry uses, so the merged text stays valid."""
    counters: dict[str, list[str]] = {}
    replica: dict[str, list[str]] = {}
    for role in ("router", "tokenizer", "scheduler", "detokenizer", "http"):
        for hb in liveness.alive(role):
            for name, value in sorted(hb.counters.items()):
                counters.setdefault(f"switchyard_{role}_{name}_total", []).append(f'{{index="{hb.index}"}} {value}')
            if role == "scheduler":
                for name, value in _replica_load(hb):
                    replica.setdefault(f"switchyard_replica_{name}", []).append(f'{{replica="{hb.index}"}} {value}')
    lines = []
    for kind, families in (("counter", counters), ("gauge", replica)):
        for name, samples in families.items():
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(name + s for s in samples)
    return "\n".join(lines) + "\n" if lines else ""


def _replica_load(hb: Heartbeat):
    yield "queue_size", hb.queue
    yield "batch_current_size", hb.running
    yield "kv_blocks_free", hb.free_blocks
    yield "kv_blocks_total", hb.total_blocks
