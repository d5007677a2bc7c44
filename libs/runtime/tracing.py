"""OpenTelemetry tracing: one span per hop, linked through W3C `traceparent` strings on the bus.

A request's trace crosses processes, so its context travels as text: http reads the client's `traceparent` header
(or starts a trace), and each message that carries a request on (GenerateRequest.traceparent,
TokenizedRequest.traceparent) holds the traceparent of the span that sent it. A hop continues from there with
`span(name, traceparent)` around a block (`current_traceparent()` inside it names the span to pass on), or with
`start(...)` / `.end()` and `traceparent_of(sp)` when the hop outlives one block (a request waiting in the
scheduler's queue). `init` once per process; without an endpoint nothing is recorded or exported, but a continued
traceparent passes through unchanged, so a later hop with tracing on stays in the client's trace. Export is OTLP
over gRPC with a BatchSpanProcessor (spans leave in the background, never on the hot path), as TGI's
`--otlp-endpoint` / `--otlp-service-name`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("switchyard.tracing")

_propagator = TraceContextTextMapPropagator()
_provider = None  # the SDK TracerProvider once init() gave an endpoint or exporter
_tracer: trace.Tracer = trace.NoOpTracer()


def init(service_name: str, otlp_endpoint: str = "", *, exporter=None, **resource: str) -> None:
    """Set up this process's tracer. `exporter` (any SpanExporter, e.g. the SDK's in-memory one in
    tests) is used as is, with a simple synchronous processor; else an OTLP gRPC exporter for
    `otlp_endpoint`; with neither, tracing stays off. `resource` adds resource attributes (e.g.
    role="scheduler", index="0" → service.instance.id). Calling it again replaces the tracer."""
    global _provider, _tracer
    shutdown()
    if exporter is None and not otlp_endpoint:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attrs = {"service.name": service_name}
    if "role" in resource:
        attrs["service.instance.id"] = f"{resource['role']}.{resource.get('index', '0')}"
    attrs.update({f"switchyard.{k}": str(v) for k, v in resource.items()})
    provider = TracerProvider(resource=Resource.create(attrs))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        # imported only when used: grpc is slow to import and most runs do not trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
        log.info("exporting traces to %s as %s", otlp_endpoint, service_name)
    _provider = provider
    _tracer = provider.get_tracer("switchyard")


def shutdown() -> None:
    """Flush and stop the exporter (also run at exit); tracing is off afterwards."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = None, trace.NoOpTracer()


atexit.register(shutdown)


def enabled() -> bool:
    return _provider is not None


def _parent(traceparent: str | None) -> Context | None:
    if not traceparent:
        return None
    ctx = _propagator.extract({"traceparent": traceparent})
    # a malformed header gives no valid span context: start a new trace, as TGI does
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def start(name: str, traceparent: str | None = None, **attrs) -> trace.Span:
    """A started span, child of `traceparent` when given (else of the current span, else a new
    trace); call `.end()` on it."""
    sp = _tracer.start_span(name, context=_parent(traceparent))
    if attrs and sp.is_recording():
        sp.set_attributes({k: v for k, v in attrs.items() if v is not None})
    return sp


@contextlib.contextmanager
def span(name: str, traceparent: str | None = None, **attrs) -> Iterator[trace.Span]:
    """A span for the block, current inside it (so `current_traceparent()` names it); an exception
    is recorded on it and re-raised."""
    sp = start(name, traceparent, **attrs)
    with trace.use_span(sp, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield sp


def traceparent_of(sp: trace.Span) -> str | None:
    """The W3C traceparent naming `sp`, or None when there is no valid trace to continue."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(sp))
    return carrier.get("traceparent")


def current_traceparent() -> str | None:
    """The traceparent of the current span (inside `span(...)`), or None outside any trace."""
    return traceparent_of(trace.get_current_span())
