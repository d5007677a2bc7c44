"""The scheduler's observer: TGI's batch metrics and the queue/prefill/decode spans of each request, driven
through a real Batcher step by step (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.protocol import codec
from libs.protocol.messages import TokenizedRequest
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from libs.runtime import metrics, tracing
from services.scheduler.batcher import Batcher
from services.scheduler.telemetry import StepObserver

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def req(rid: str, prompt_len: int, max_new: int) -> TokenizedRequest:
    ids = np.arange(10, 10 + prompt_len, dtype=np.int32)
    return TokenizedRequest(
        request_id=rid,
        ingress=0,
        input_ids=ids,
        sampling=SamplingParams(),
        max_new_tokens=max_new,
        traceparent=TRACEPARENT,
    )


def step(b: Batcher, obs: StepObserver, n: int, error: str | None = None):
    obs.plan_started()
    plan = b.plan(n)
    obs.planned(plan)
    seqs = plan.seqs.tolist()
    res = StepResult(
        step=n,
        forward_s=0.01,
        error=error,
        seqs=np.array(seqs, np.int32),
        token_ids=np.full(len(seqs), 5, np.int32),
        logprobs=np.zeros(len(seqs), np.float32),
    )
    res = codec.decode(codec.encode(res))  # as the scheduler receives it: every frame an array
    obs.result(n, res)
    rows = b.apply(res)
    obs.applied(n)
    obs.emitted(rows)
    tps = {row.seq.req.request_id: obs.traceparent(row.seq.req.request_id) for row in rows if row.offset == 0}
    obs.ended(rows)
    obs.published(0.001)
    return rows, tps


@pytest.fixture
def exporter():
    metrics.init("scheduler", 0)
    exp = InMemorySpanExporter()
    tracing.init("svc", exporter=exp, role="scheduler", index="0")
    yield exp
    tracing.shutdown()


def value(name: str, **labels) -> float:
    return metrics.get().registry.get_sample_value(name, labels) or 0.0


def test_metrics_and_spans_of_two_requests(exporter):
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids=set())
    obs = StepObserver(b)
    for r in (req("a", 20, 3), req("b", 10, 1)):
        obs.arrived(r)
        b.add(r)
    obs.gauges()
    assert value("tgi_queue_size") == 2 and value("switchyard_hop_queue_depth", hop="scheduler") == 2
    _, tps = step(b, obs, 1)  # both prefill; b ends at its first token
    obs.gauges()
    assert value("tgi_batch_current_size") == 1 and value("tgi_batch_current_max_tokens") == 23
    assert value("switchyard_kv_blocks_used") == 2 and value("switchyard_kv_blocks_free") == 98
    step(b, obs, 2)
    step(b, obs, 3)  # a ends
    assert value("tgi_batch_inference_count_total", method="prefill") == 1
    assert value("tgi_batch_inference_count_total", method="decode") == 2
    assert value("tgi_batch_inference_success_total", method="decode") == 2
    assert value("tgi_batch_forward_duration_count", method="decode") == 2
    assert value("tgi_batch_next_size_sum") == 2 and value("tgi_batch_next_size_count") == 1
    for phase in ("plan", "forward", "sample", "publish"):
        assert value("switchyard_step_duration_seconds_count", phase=phase) == 3
    assert value("switchyard_hop_duration_seconds_count", hop="scheduler_queue") == 2
    spans = {(s.name, s.attributes["request_id"]): s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        ("scheduler_queue", "a"),
        ("prefill", "a"),
        ("decode", "a"),
        ("scheduler_queue", "b"),
        ("prefill", "b"),
    }
    assert {format(s.parent.span_id, "016x") for s in spans.values()} == {"00f067aa0ba902b7"}
    # the detokenizer continues from decode, or from prefill when the first token was the last
    assert tps["a"].split("-")[2] == format(spans["decode", "a"].context.span_id, "016x")
    assert tps["b"].split("-")[2] == format(spans["prefill", "b"].context.span_id, "016x")
    assert spans["decode", "a"].attributes["generated_tokens"] == 3
    assert not obs.spans and not obs.arrived_at


def test_tracing_off_keeps_nothing_per_request():
    metrics.init("scheduler", 0)
    tracing.shutdown()
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids=set())
    obs = StepObserver(b)
    r = req("a", 4, 2)
    obs.arrived(r)
    b.add(r)
    _, tps = step(b, obs, 1)
    assert tps == {"a": None} and not obs.spans
    step(b, obs, 2)
    assert not obs.arrived_at


def test_failed_step_counts_as_failure():
    metrics.init("scheduler", 0)
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids=set())
    obs = StepObserver(b)
    b.add(req("a", 4, 2))
    obs.plan_started()
    obs.planned(b.plan(1))
    obs.result(1, StepResult(step=1, error="boom"))
    assert value("tgi_batch_inference_failure_total", method="prefill") == 1
    assert value("tgi_batch_inference_success_total", method="prefill") == 0


def test_speculative_counters_and_skipped_tokens():
    metrics.init("scheduler", 0)
    b = Batcher(64, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={2}, speculate=4)
    obs = StepObserver(b)
    loop = [11, 12, 13, 14, 15, 16] * 3  # lookup drafts 12 13 14 15 after a sampled 11
    b.add(TokenizedRequest(request_id="a", ingress=0, input_ids=np.asarray(loop, np.int32),
                           sampling=SamplingParams(), max_new_tokens=20))  # fmt: skip
    for n, tokens in ((1, [11]), (2, [12, 13, 99])):  # step 2: 4 drafted, 2 accepted, one more token
        obs.plan_started()
        plan = b.plan(n)
        obs.planned(plan)
        res = StepResult(
            step=n,
            seqs=plan.seqs,
            token_counts=np.array([len(tokens)], np.int32),
            token_ids=np.array(tokens, np.int32),
            logprobs=np.zeros(len(tokens), np.float32),
        )
        res = codec.decode(codec.encode(res))
        obs.result(n, res)
        b.apply(res)
        obs.applied(n)
    obs.gauges()
    assert value("switchyard_speculative_draft_tokens_total") == 4
    assert value("switchyard_speculative_accepted_tokens_total") == 2
    assert value("tgi_request_skipped_tokens_count") == 2 and value("tgi_request_skipped_tokens_sum") == 2
