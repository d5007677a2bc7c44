"""Observability of a real server: /metrics after known traffic, the span tree of one request
exported over OTLP to a collector inside the test, and --json-output logs from every process.

One server for the three tests: tiny model, --json-output, --otlp-endpoint at the in-test collector
(a real OTLP/gRPC TraceService), two concurrent requests at most (so an overload is easy to make).
The metrics test works on differences between two scrapes, so it does not depend on the order of tests.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from concurrent import futures

import aiohttp
import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from libs.runtime.metrics import DURATION_BUCKETS
from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

MAX_TOTAL, MAX_INPUT = 512, 400
ROLES = ("router", "tokenizer", "scheduler", "shard", "detokenizer", "http")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps every span it is sent."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        for rs in request.resource_spans:
            resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    span = {
                        "name": sp.name,
                        "trace_id": sp.trace_id.hex(),
                        "span_id": sp.span_id.hex(),
                        "parent": sp.parent_span_id.hex(),
                        "start": sp.start_time_unix_nano,
                        "end": sp.end_time_unix_nano,
                        "attributes": {kv.key: _value(kv.value) for kv in sp.attributes},
                        "resource": resource,
                    }
                    with self.lock:
                        self.spans.append(span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.stop(0)


@pytest.fixture(scope="module")
def obs_server(tiny_model_dir, tmp_path_factory, collector):
    log = tmp_path_factory.mktemp("logs") / "observability-server.log"
    flags = [
        *("--max-total-tokens", str(MAX_TOTAL), "--max-input-tokens", str(MAX_INPUT)),
        *("--max-concurrent-requests", "2", "--json-output"),
        *("--otlp-endpoint", f"http://127.0.0.1:{collector.port}"),
    ]
    # spans leave each process every 100 ms instead of every 5 s (the SDK's BatchSpanProcessor)
    # no progress bars: the shard's model loading would draw them (not logs) between the JSON lines
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    with Server(tiny_model_dir, log, *flags, env=env, clean_log=False) as server:  # the tests provoke errors on purpose
        yield server


# --------------------------------------------------------------------------------------------
# /metrics


def scrape(url: str) -> tuple[dict[tuple[str, tuple], float], dict[str, str]]:
    r = requests.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
    samples, types = {}, {}
    for fam in text_string_to_metric_families(r.text):  # also proves the text is valid
        types[fam.name] = fam.type
        for s in fam.samples:
            # the parser names every counter sample x_total; TGI's counters are bare (checked below)
            name = fam.name if fam.name.startswith("tgi_") and s.name == fam.name + "_total" else s.name
            samples[(name, tuple(sorted(s.labels.items())))] = s.value
    assert re.search(r"^tgi_request_count \S+$", r.text, re.M), "TGI's bare counter names"
    return samples, types


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def buckets(samples, name: str) -> list[float]:
    return sorted(float(dict(k)["le"]) for n, k in samples if n == name + "_bucket" and not set(dict(k)) - {"le"})


def generate(url: str, text: str, n: int) -> int:
    body = {"inputs": text, "parameters": {"max_new_tokens": n, "details": True}}
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_tokens"]


def stream(url: str, text: str, n: int) -> int:
    body = {"inputs": text, "parameters": {"max_new_tokens": n}}
    with requests.post(url + "/generate_stream", json=body, stream=True, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith(b"data:")]
    assert events[-1].get("generated_text") is not None, events[-1]
    return events[-1]["details"]["generated_tokens"] if events[-1].get("details") else len(events)


def long_prompt(url: str, n: int) -> str:
    """A prompt the tiny model answers with all `n` tokens (no EOS on the way), so a stream of it lasts."""
    for i in range(40):
        text = f"hold the line {i} " * 3
        body = {"inputs": text, "parameters": {"max_new_tokens": n, "details": True}}
        if requests.post(url + "/generate", json=body, timeout=120).json()["details"]["finish_reason"] == "length":
            return text
    raise AssertionError("no prompt runs to full length")


def test_metrics_count_known_traffic(obs_server):
    url = obs_server.url
    hold = long_prompt(url, 400)
    before, _ = scrape(url)
    generated = [generate(url, f"request number {i} says", n) for i, n in enumerate((3, 7, 12, 1))]
    generated += [stream(url, "a streamed request", 9), stream(url, "another streamed one", 4)]
    bad = [
        {"inputs": "x", "parameters": {"max_new_tokens": 0}},
        {"inputs": "", "parameters": {}},
        {"inputs": "x", "parameters": {"temperature": 0.0}},
    ]
    for body in bad:
        assert requests.post(url + "/generate", json=body, timeout=30).status_code == 422

    # two long streams hold both permits: the next request is refused (429), then the streams are dropped
    async def overload() -> int:
        async with aiohttp.ClientSession() as session:
            held = []
            for _ in range(2):
                body = {"inputs": hold, "parameters": {"max_new_tokens": 400}}
                r = await session.post(url + "/generate_stream", json=body)
                assert (await r.content.readline()).startswith(b"data:")
                held.append(r)
            async with session.post(url + "/generate", json={"inputs": "one too many"}) as r:
                assert r.status == 429 and (await r.json())["error_type"] == "overloaded"
            for r in held:
                r.close()  # the client goes away: TGI's failure{err="dropped"}
            return len(held)

    dropped = asyncio.run(overload())

    ok, total = len(generated), sum(generated)
    expected = {
        ("tgi_request_count", ()): ok + len(bad) + 1 + dropped,
        ("tgi_request_success", ()): ok,
        ("tgi_request_failure", (("err", "validation"),)): len(bad),
        ("tgi_request_failure", (("err", "overloaded"),)): 1,
        ("tgi_request_failure", (("err", "dropped"),)): dropped,
        ("tgi_request_generated_tokens_sum", ()): total,
        ("tgi_request_generated_tokens_count", ()): ok,
        ("tgi_request_duration_count", ()): ok,
        ("tgi_request_mean_time_per_token_duration_count", ()): ok,
        ("switchyard_time_to_first_token_seconds_count", ()): ok + dropped,
    }

    def deltas(now):
        return {k: now.get(k, 0.0) - before.get(k, 0.0) for k in expected}

    def grown(now, name, **labels):
        return value(now, name, **labels) - value(before, name, **labels)

    # the drops reach http when the connections close; other processes' metrics come with their heartbeats
    # (a heartbeat carries metrics at most every max(1 s, 1000 x their rendering time))
    deadline = time.monotonic() + 30
    while True:
        after, types = scrape(url)
        got = deltas(after)
        others = (
            grown(after, "tgi_batch_inference_count", method="decode") > 0
            and grown(after, "switchyard_detokenized_tokens_total", index="0") >= total + 2  # + the held streams'
            and grown(after, "switchyard_tokenized_tokens_total", index="0") > 0
            # a heartbeat may render between the scheduler's count and its forward-time observation
            and all(
                value(after, "tgi_batch_inference_count", method=m)
                == value(after, "tgi_batch_forward_duration_count", method=m)
                for m in ("prefill", "decode")
            )
        )
        if got == expected and others or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == expected
    # per-request histograms: TGI's names, types and buckets
    assert types["tgi_request_count"] == "counter" and types["tgi_request_duration"] == "histogram"
    assert buckets(after, "tgi_request_duration") == pytest.approx([*DURATION_BUCKETS, float("inf")])
    linear = [MAX_TOTAL / 100 * (x + 1) for x in range(100)] + [float("inf")]
    assert buckets(after, "tgi_request_generated_tokens") == pytest.approx(linear)
    assert buckets(after, "tgi_request_input_length") == pytest.approx(
        [MAX_INPUT / 100 * (x + 1) for x in range(100)] + [float("inf")]
    )
    assert len(buckets(after, "tgi_batch_next_size")) == 1025
    # the max_new_tokens the tokenizer resolved: one per placed request (the held ones too)
    assert value(after, "tgi_request_max_new_tokens_sum") - value(before, "tgi_request_max_new_tokens_sum") == (
        3 + 7 + 12 + 1 + 9 + 4 + 400 * dropped
    )
    # the scheduler's side: prefill and decode steps, each with its forward time; every token detokenized
    for method in ("prefill", "decode"):
        count = value(after, "tgi_batch_inference_count", method=method)
        assert count > value(before, "tgi_batch_inference_count", method=method)
        assert value(after, "tgi_batch_forward_duration_count", method=method) == count
    for phase in ("plan", "forward", "sample", "publish"):
        assert value(after, "switchyard_step_duration_seconds_count", phase=phase) > 0
    assert grown(after, "switchyard_detokenized_tokens_total", index="0") >= total + 2
    assert grown(after, "switchyard_tokenized_tokens_total", index="0") > 0
    blocks = value(after, "switchyard_kv_blocks_used") + value(after, "switchyard_kv_blocks_free")
    assert blocks == value(after, "switchyard_replica_kv_blocks_total", replica="0") > 0
    for role in ROLES:
        assert value(after, "switchyard_process_up", role=role, index="0") == 1, role


# --------------------------------------------------------------------------------------------
# Traces


def test_span_tree_of_one_request(obs_server, collector):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    body = {"inputs": "follow this request", "parameters": {"max_new_tokens": 6}}
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    r = requests.post(obs_server.url + "/generate", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    hops = {"http", "tokenizer", "router", "scheduler_queue", "prefill", "decode", "detokenizer"}
    deadline = time.monotonic() + 15
    while {s["name"] for s in collector.trace(trace_id)} != hops and time.monotonic() < deadline:
        time.sleep(0.2)
    spans = collector.trace(trace_id)
    by_name = {s["name"]: s for s in spans}
    assert sorted(s["name"] for s in spans) == sorted(hops)  # one span per hop, all in the client's trace
    parent_of = {name: s["parent"] for name, s in by_name.items()}
    id_of = {name: s["span_id"] for name, s in by_name.items()}
    assert parent_of["http"] == parent_id
    assert parent_of["tokenizer"] == id_of["http"]
    assert parent_of["router"] == id_of["tokenizer"]
    assert parent_of["scheduler_queue"] == parent_of["prefill"] == parent_of["decode"] == id_of["router"]
    assert parent_of["detokenizer"] == id_of["decode"]
    # each hop's span comes from its own process, and they follow one another in time
    roles = {name: s["resource"]["service.instance.id"] for name, s in by_name.items()}
    assert roles["http"] == "http.0" and roles["tokenizer"] == "tokenizer.0" and roles["router"] == "router.0"
    assert roles["prefill"] == roles["decode"] == "scheduler.0" and roles["detokenizer"] == "detokenizer.0"
    assert {s["resource"]["service.name"] for s in spans} == {"text-generation-inference.router"}
    start = {name: s["start"] for name, s in by_name.items()}
    assert start["http"] <= start["tokenizer"] <= start["router"] <= start["scheduler_queue"] <= start["prefill"]
    assert by_name["scheduler_queue"]["end"] <= start["prefill"] <= by_name["prefill"]["end"] <= start["decode"]
    assert len({s["attributes"]["request_id"] for s in spans}) == 1
    assert by_name["decode"]["attributes"]["generated_tokens"] == 6


# --------------------------------------------------------------------------------------------
# Logs


def test_json_logs_from_every_process(obs_server):
    bad = requests.post(obs_server.url + "/generate", json={"inputs": "", "parameters": {}}, timeout=30)
    assert bad.status_code == 422
    assert requests.post(obs_server.url + "/generate", json={"inputs": "hello", "parameters": {}}).status_code == 200
    time.sleep(0.5)  # let the last lines reach the log
    records, other = [], []
    # "\r" too: the shard's model-loading progress bars (transformers' tqdm) would redraw with it
    for line in re.split(r"[\r\n]", obs_server.log_path.read_text()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if line.strip() and not line.startswith("Loading weights"):  # the progress bars: not a log
                other.append(line)
    # Plain text comes only from the launcher and supervisord (not services). The log file is written
    # through two descriptions (the launcher's stdout and supervisord's own open of /dev/stdout, each with
    # its own offset), so the launcher's lines can overwrite the head of a service's first lines: such a
    # tail of a JSON object is not a plain-text line of a service.
    launcher = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBG|INFO|WARN|ERRO|CRIT) ")
    plain = [line for line in other if not launcher.match(line) and not line.endswith('"}')]
    assert not plain, plain[:5]
    assert all(not line.startswith("{") for line in other), [line for line in other if line.startswith("{")][:5]
    services = set()
    for rec in records:
        assert {"timestamp", "level", "service", "index", "message"} <= rec.keys(), rec
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", rec["timestamp"]), rec
        assert rec["level"] in ("TRACE", "DEBUG", "INFO", "WARN", "ERROR")
        services.add(rec["service"])
    # the tails of overwritten lines still name their service
    services.update(m for line in other for m in re.findall(r'"service": "(\w+)"', line))
    assert services >= set(ROLES)
    # the rejected request is one id across processes: the tokenizer rejected it, http reported it
    rejected = [r for r in records if r["service"] == "tokenizer" and "`inputs` cannot be empty" in r["message"]]
    assert rejected and re.fullmatch(r"[0-9a-f]{32}", rejected[-1]["request_id"])
    rid = rejected[-1]["request_id"]
    assert any(r["service"] == "http" and r.get("request_id") == rid for r in records)
    assert any(r["service"] == "http" and r["message"].startswith("Success") and "request_id" in r for r in records)
