"""Metrics: TGI's names and buckets, compact per-process texts, and their merge into one /metrics."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.protocol import Addresses
from libs.runtime import bus, metrics
from libs.runtime.metrics import DURATION_BUCKETS, Aggregator, Metrics, merge


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.fixture
def defs():
    return Metrics("http", 0, max_input_tokens=400, max_total_tokens=512)


def test_tgi_buckets(defs):
    assert DURATION_BUCKETS[0] == pytest.approx(0.00015) and DURATION_BUCKETS[-1] == pytest.approx(145.611, rel=1e-4)
    assert len(DURATION_BUCKETS) == 35
    assert defs.layouts["tgi_request_duration"] == (*DURATION_BUCKETS, float("inf"))
    assert defs.layouts["tgi_request_input_length"][:3] == (4.0, 8.0, 12.0)
    assert defs.layouts["tgi_request_generated_tokens"][-2] == 512.0
    assert len(defs.layouts["tgi_request_max_new_tokens"]) == 101
    assert defs.layouts["tgi_batch_next_size"] == (*(float(n) for n in range(1, 1025)), float("inf"))


def test_fresh_process_sends_little():
    text = Metrics("tokenizer", 2).exposition()
    assert len(text) < 1500
    names = {fam.name for fam in text_string_to_metric_families(text)}
    assert names and all(n.startswith("switchyard_process_") for n in names)
    assert 'switchyard_process_up{index="2",role="tokenizer"} 1.0' in lines(text)


def test_merge_sums_counters_histograms_and_keeps_labels_apart(defs):
    a, b, both = Metrics("scheduler", 0), Metrics("scheduler", 1), Metrics("scheduler", 9)
    for m, n in ((a, 3), (b, 4)):
        for target in (m, both):
            target.request_count.inc(n)
            target.request_failure.labels(err="validation").inc(n)
            target.queue_size.inc(n)
            target.batch_inference_count.labels(method="prefill" if n == 3 else "decode").inc()
            for i in range(n):
                target.request_duration.observe(0.01 * (i + 1) * n)
                target.batch_forward_duration.labels(method="decode").observe(0.002 * i)
            target.step_duration.labels(phase="forward").observe(0.05 * n)
    a.request_failure.labels(err="overloaded").inc()
    both.request_failure.labels(err="overloaded").inc()
    text = merge([a.exposition(), b.exposition()], definitions=defs)
    got = samples(text)
    assert "tgi_request_count 7.0" in lines(text)  # TGI's name: no _total
    assert 'tgi_request_failure{err="validation"} 7.0' in lines(text)
    assert 'tgi_request_failure{err="overloaded"} 1.0' in lines(text)
    assert "tgi_queue_size 7.0" in lines(text)  # gauges sum too: queue over replicas
    assert 'tgi_batch_inference_count{method="prefill"} 1.0' in lines(text)
    assert 'tgi_batch_inference_count{method="decode"} 1.0' in lines(text)
    assert 'switchyard_step_duration_seconds_count{phase="forward"} 2.0' in lines(text)
    # every bucket of the merged histograms equals one registry that saw all the observations
    reference = samples(merge([both.exposition()], definitions=defs))
    for name in ("tgi_request_duration", "tgi_batch_forward_duration"):
        mine = {k: v for k, v in got.items() if k[0].startswith(name)}
        theirs = {k: v for k, v in reference.items() if k[0].startswith(name)}
        assert mine == pytest.approx(theirs)
        assert sum(1 for k in mine if k[0].endswith("_bucket")) == 36  # the full layout, restored
    # per-process series stay apart by role/index
    assert got[("switchyard_process_up", (("index", "0"), ("role", "scheduler")))] == 1
    assert got[("switchyard_process_up", (("index", "1"), ("role", "scheduler")))] == 1
    cpu = [k for k in got if k[0] == "switchyard_process_cpu_seconds_total"]
    assert len(cpu) == 2


def test_merge_is_valid_text_with_help_and_type(defs):
    m = Metrics("router", 0)
    m.request_count.inc()
    m.prefix_cache_hit_tokens.inc(5)
    text = merge([m.exposition()], definitions=defs)
    assert "# HELP tgi_request_count Total number of requests" in lines(text)
    assert "# TYPE tgi_request_count counter" in lines(text)
    assert "switchyard_prefix_cache_hit_tokens_total 5.0" in lines(text)
    for line in lines(text):  # every line is a comment or `name{labels} value`
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or float(line.rsplit(" ", 1)[1]) >= 0
    types = [line.split()[2] for line in lines(text) if line.startswith("# TYPE")]
    assert len(types) == len(set(types))  # one family block per name
    assert "unknown" not in {fam.type for fam in text_string_to_metric_families(text)}
    assert merge([text], definitions=defs) == text  # merging a merged text changes nothing


def test_unrecorded_unlabelled_metrics_are_zero(defs):
    got = samples(merge([], definitions=defs))
    assert got[("tgi_request_count_total", ())] == 0  # the parser's name for the bare counter
    assert got[("tgi_queue_size", ())] == 0
    assert got[("tgi_request_duration_bucket", (("le", "+Inf"),))] == 0
    assert not any(k[0].startswith("tgi_request_failure") for k in got)  # labelled: nothing yet


def test_label_values_are_escaped(defs):
    m = Metrics("http", 0)
    m.hop_queue_depth.labels(hop='a"b\\c\nd').set(2)
    got = samples(merge([m.exposition()], definitions=defs))
    assert got[("switchyard_hop_queue_depth", (("hop", 'a"b\\c\nd'),))] == 2


def hb(role, index, pid, text):
    return SimpleNamespace(role=role, index=index, pid=pid, metrics=text)


def test_aggregator_restarts_and_staleness():
    metrics.init("http", 0)
    agg = Aggregator("http", 0, stale_after=0.2)
    first = Metrics("detokenizer", 0)
    first.detokenized_tokens.inc(10)
    first.queue_size.set(5)
    agg.observe(hb("detokenizer", 0, 100, first.exposition()))
    agg.observe(hb("detokenizer", 0, 100, ""))  # rate-limited heartbeat: keeps the last text
    assert 'switchyard_detokenized_tokens_total{index="0"} 10.0' in lines(agg.render())
    second = Metrics("detokenizer", 0)  # restarted: a new pid, counters from zero
    second.detokenized_tokens.inc(3)
    agg.observe(hb("detokenizer", 0, 200, second.exposition()))
    text = agg.render()
    assert 'switchyard_detokenized_tokens_total{index="0"} 13.0' in lines(text)  # never goes back
    assert "tgi_queue_size 0.0" in lines(text)  # the dead process's gauges are gone
    assert 'switchyard_process_restarts_total{index="0",role="detokenizer"} 1.0' in lines(text)
    assert 'switchyard_process_up{index="0",role="detokenizer"} 1.0' in lines(text)
    time.sleep(0.3)
    text = agg.render()
    assert 'switchyard_process_up{index="0",role="detokenizer"} 0.0' in lines(text)
    assert 'switchyard_detokenized_tokens_total{index="0"} 13.0' in lines(text)
    assert 'switchyard_process_up{index="0",role="http"} 1.0' in lines(text)  # our own, read fresh


def test_a_heartbeat_text_is_parsed_once_however_often_it_is_scraped():
    """Parsing is most of a scrape's cost: a process's last text is parsed at its first merge, then reused."""
    from libs.runtime import promtext

    metrics.init("http", 0)
    agg = Aggregator("http", 0)
    for role in ("detokenizer", "tokenizer"):
        other = Metrics(role, 0)
        other.queue_size.set(3)
        agg.observe(hb(role, 0, 100, other.exposition()))
    first = agg.render()
    before = promtext.families.cache_info()
    second = agg.render()
    assert "tgi_queue_size 6.0" in lines(first) and "tgi_queue_size 6.0" in lines(second)  # both texts, summed
    after = promtext.families.cache_info()
    assert after.hits - before.hits == 2  # both processes' texts; http's own is read fresh
    assert after.misses - before.misses == 1


def test_heartbeat_carries_metrics(tmp_path):
    m = metrics.init("tokenizer", 3)
    m.tokenized_tokens.inc(42)
    events = bus.EventBus(Addresses.parse(f"ipc://{tmp_path}"), "tokenizer", 3, [])
    sent = []
    events.publish = lambda topic, msg: sent.append((topic, msg))
    before = time.time()
    events.heartbeat(queue=1)
    events.heartbeat(queue=1)  # not due yet
    assert len(sent) == 1
    topic, beat = sent[0]
    assert topic == b"hb.tokenizer.0003" and beat.queue == 1
    assert 'switchyard_tokenized_tokens_total{index="3"} 42.0' in lines(beat.metrics)
    stamped = r'^switchyard_metrics_rendered_timestamp_seconds\{index="3",role="tokenizer"\} (\S+)$'
    stamp = re.search(stamped, beat.metrics, re.M)
    assert stamp and before <= float(stamp.group(1)) <= time.time()  # the render's own time, in it
    events.pub.close()
    events.sub.close()


def test_exposition_is_cheap():
    m = Metrics("scheduler", 0)
    for i in range(200):
        m.batch_next_size.observe(i % 64 + 1)
        m.batch_inference_duration.labels(method="decode").observe(0.001 * i)
    m.exposition()
    start = time.perf_counter()
    for _ in range(10):
        m.exposition()
    assert (time.perf_counter() - start) / 10 < 0.01  # ~1 ms on an idle core; generous for a busy CI box


def test_dashboard_queries_defined_metrics(defs):
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[3] / "deploy/grafana/switchyard.json").read_text())
    known = set()
    for name, (kind, _doc) in defs.definitions.items():
        known |= {name, name + "_total"} if kind == "counter" else {name}
        if kind in ("histogram", "summary"):
            known |= {name + "_bucket", name + "_sum", name + "_count"}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) > 10
    used = {m for e in exprs for m in re.findall(r"\b((?:tgi|switchyard)_[a-z_]+)", e)}
    assert used and used <= known, used - known
