"""What http records per request: TGI's request metrics with TGI's err labels, and the trace context it passes on."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.protocol.messages import FinalInfo, GenerateRequest, Heartbeat
from libs.protocol.params import Parameters
from libs.runtime import metrics, tracing
from libs.runtime.liveness import Liveness
from services.http import telemetry
from services.http.timing import Timing

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def wire(rid: str = "r1", traceparent: str | None = TRACEPARENT) -> GenerateRequest:
    return GenerateRequest(request_id=rid, ingress=0, inputs="x", parameters=Parameters(), traceparent=traceparent)


def value(name: str, **labels) -> float:
    return metrics.get().registry.get_sample_value(name, labels) or 0.0


def test_success_records_tgi_request_metrics():
    metrics.init("http", 0)
    timing = Timing(start=10.0, accepted=10.5, first=11.0, last=13.0)
    rec = telemetry.RequestRecord(wire(), timing)
    rec.accepted(7, 20)
    rec.row(11.0)
    rec.row(11.5)
    rec.success(FinalInfo(generated_text="ab", finish_reason="length", generated_tokens=4, input_length=7))
    assert value("tgi_request_count_total") == 1 and value("tgi_request_success_total") == 1
    assert value("tgi_request_generated_tokens_sum") == 4 and value("tgi_request_input_length_sum") == 7
    assert value("tgi_request_max_new_tokens_sum") == 20
    assert value("tgi_request_validation_duration_sum") == 0.5 and value("tgi_request_queue_duration_sum") == 0.5
    assert value("tgi_request_inference_duration_sum") == 2.0
    assert value("tgi_request_mean_time_per_token_duration_sum") == 0.5
    assert value("switchyard_time_to_first_token_seconds_sum") == 1.0
    assert value("switchyard_inter_token_latency_seconds_sum") == 0.5
    rec.dropped()  # after the end: nothing more
    assert value("tgi_request_failure_total", err="dropped") == 0


def test_failures_use_tgi_err_labels_and_quiet_requests_are_not_counted():
    metrics.init("http", 0)
    for error_type in ("validation", "template_error", "tool_error", "generation", "incomplete_generation"):
        telemetry.RequestRecord(wire(), Timing(start=0.0)).failure("no", error_type)
    telemetry.RequestRecord(wire(), Timing(start=0.0)).dropped()
    telemetry.count_overloaded()
    telemetry.RequestRecord(wire(), Timing(start=0.0), quiet=True).failure("no", "validation")
    assert value("tgi_request_count_total") == 7
    got = {err: value("tgi_request_failure_total", err=err) for err in telemetry.ERR_LABEL.values()}
    assert got == {"validation": 1, "template": 2, "generation": 1, "incomplete": 1, "overloaded": 1}
    assert value("tgi_request_failure_total", err="dropped") == 1


def test_trace_context_passes_on():
    tracing.shutdown()
    req = wire()
    telemetry.RequestRecord(req, Timing(start=0.0)).dropped()
    assert req.traceparent == TRACEPARENT  # tracing off: the client's context goes on unchanged
    exporter = InMemorySpanExporter()
    tracing.init("svc", exporter=exporter, role="http", index="0")
    try:
        req = wire()
        telemetry.RequestRecord(req, Timing(start=0.0)).failure("bad", "validation")
        (span,) = exporter.get_finished_spans()
        assert span.name == "http" and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
        assert req.traceparent.split("-")[2] == format(span.context.span_id, "016x")
        assert span.status.status_code.name == "ERROR"
    finally:
        tracing.shutdown()


def test_legacy_text_is_valid_and_per_process():
    from prometheus_client.parser import text_string_to_metric_families

    lv = Liveness()
    lv.record(
        Heartbeat(role="scheduler", index=0, pid=1, queue=2, free_blocks=5, total_blocks=9, counters={"steps": 3})
    )
    lv.record(Heartbeat(role="tokenizer", index=1, pid=2, counters={"handled": 4}))
    fams = {f.name: f for f in text_string_to_metric_families(telemetry.legacy_text(lv))}
    assert fams["switchyard_scheduler_steps"].samples[0].value == 3
    assert fams["switchyard_tokenizer_handled"].samples[0].labels == {"index": "1"}
    assert fams["switchyard_replica_kv_blocks_free"].samples[0].labels == {"replica": "0"}
