"""Tracing: spans continue a W3C traceparent, hops link into one tree, no endpoint means no export."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.runtime import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    tracing.init("text-generation-inference.router", exporter=exp, role="tokenizer", index="0")
    yield exp
    tracing.shutdown()


def test_span_continues_traceparent(exporter):
    with tracing.span("tokenizer", TRACEPARENT, request_id="abc", input_length=7) as sp:
        inner = tracing.current_traceparent()
    (got,) = exporter.get_finished_spans()
    assert got.name == "tokenizer"
    assert format(got.context.trace_id, "032x") == TRACE_ID
    assert format(got.parent.span_id, "016x") == PARENT_ID
    assert got.parent.is_remote
    assert got.attributes["request_id"] == "abc" and got.attributes["input_length"] == 7
    assert got.resource.attributes["service.name"] == "text-generation-inference.router"
    assert got.resource.attributes["service.instance.id"] == "tokenizer.0"
    # inside the span, the traceparent to pass on names this span in the same trace
    assert inner == f"00-{TRACE_ID}-{format(sp.get_span_context().span_id, '016x')}-01"


def test_hops_form_one_tree(exporter):
    """One request through every hop, each continuing from the traceparent the previous one sent."""
    with tracing.span("http", TRACEPARENT):
        tp = tracing.current_traceparent()
    with tracing.span("tokenizer", tp):
        tp = tracing.current_traceparent()
    with tracing.span("router", tp):
        tp = tracing.current_traceparent()
    queue = tracing.start("scheduler_queue", tp)  # ends when the request is scheduled
    queue.end()
    with tracing.span("prefill", tp):
        pass
    decode = tracing.start("decode", tp)
    with tracing.span("detokenizer", tracing.traceparent_of(decode)):
        pass
    decode.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"http", "tokenizer", "router", "scheduler_queue", "prefill", "decode", "detokenizer"}
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TRACE_ID}
    parent = {name: s.parent.span_id for name, s in spans.items()}
    span_id = {name: s.context.span_id for name, s in spans.items()}
    assert parent["http"] == int(PARENT_ID, 16)
    assert parent["tokenizer"] == span_id["http"]
    assert parent["router"] == span_id["tokenizer"]
    assert parent["scheduler_queue"] == parent["prefill"] == parent["decode"] == span_id["router"]
    assert parent["detokenizer"] == span_id["decode"]


def test_exception_is_recorded(exporter):
    with pytest.raises(ValueError), tracing.span("shard"):
        raise ValueError("boom")
    (got,) = exporter.get_finished_spans()
    assert got.status.status_code.name == "ERROR"
    assert got.events[0].name == "exception"


def test_malformed_traceparent_starts_a_new_trace(exporter):
    with tracing.span("http", "00-zzzz-not-a-trace"):
        pass
    (got,) = exporter.get_finished_spans()
    assert got.parent is None
    assert format(got.context.trace_id, "032x") != TRACE_ID


def test_without_endpoint_context_passes_through():
    tracing.init("svc", "")
    assert not tracing.enabled()
    with tracing.span("tokenizer", TRACEPARENT):
        assert tracing.current_traceparent() == TRACEPARENT
    with tracing.span("tokenizer"):
        assert tracing.current_traceparent() is None


def test_otlp_exporter_is_built_for_an_endpoint(monkeypatch):
    # nothing listens there: the batch processor exports in the background and gives up quietly
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    tracing.init("svc", "http://127.0.0.1:9")
    try:
        assert tracing.enabled()
        with tracing.span("http"):
            assert tracing.current_traceparent().startswith("00-")
    finally:
        tracing._provider.force_flush(timeout_millis=100)
        tracing.shutdown()
