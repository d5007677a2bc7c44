"""Prometheus metrics: one registry per process, carried in heartbeats, merged by http for /metrics.

Every process records into its own `prometheus_client` registry (`init` once at start, `get()` anywhere later);
its heartbeat carries `exposition()`, a compact text of what it recorded (format and merge:
`libs.runtime.promtext`), and http's `Aggregator` merges the last text of every process, summing samples with the
same name and labels. So /metrics scrapes one endpoint for the whole server, with TGI's metric names, labels and
buckets. Counters keep TGI's bare names (`tgi_request_count`, no `_total`); Switchyard's own counters end in
`_total`. Each process adds switchyard_process_* labelled {role,index}; the aggregator adds
switchyard_process_restarts_total. docs/observability.md shows the wiring in a service and in http.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from libs.runtime import promtext

# TGI's buckets for every metric whose name ends in "duration": 0.0001 * 1.5^k, k = 1..35
DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))


def _linear(top: int) -> tuple[float, ...]:
    """TGI's 100 linear buckets `top/100 * (x+1)`."""
    return tuple(top / 100 * (x + 1) for x in range(100))


class _Labelled:
    """Adds role/index labels to another collector's families (ProcessCollector has none)."""

    def __init__(self, inner, role: str, index: int):
        self.inner, self.labels = inner, {"role": role, "index": str(index)}

    def collect(self):
        for fam in self.inner.collect():
            out = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, **self.labels}, s.value)
            yield out


class Metrics:
    """The metric objects of one process, in its own registry. Attribute = TGI name minus `tgi_`."""

    def __init__(self, role: str, index: int, max_input_tokens: int = 4095, max_total_tokens: int = 4096):
        self.role, self.index = role, index
        r = self.registry = CollectorRegistry(auto_describe=True)

        def hist(name, doc, buckets=DURATION_BUCKETS, labels=()):
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        def counter(name, doc, labels=()):
            return Counter(name, doc, labels, registry=r)

        def gauge(name, doc, labels=()):
            return Gauge(name, doc, labels, registry=r)

        # TGI (router/src, backends/v3/src): names, labels and buckets as TGI's
        self.request_count = counter("tgi_request_count", "Total number of requests")
        self.request_success = counter("tgi_request_success", "Number of successful requests")
        self.request_failure = counter("tgi_request_failure", "Number of failed requests", ["err"])
        self.request_duration = hist("tgi_request_duration", "Request duration (s)")
        self.request_validation_duration = hist("tgi_request_validation_duration", "Validation time (s)")
        self.request_queue_duration = hist("tgi_request_queue_duration", "Time spent in the queue (s)")
        self.request_inference_duration = hist("tgi_request_inference_duration", "Inference time (s)")
        self.request_mean_time_per_token_duration = hist(
            "tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)"
        )
        self.request_generated_tokens = hist(
            "tgi_request_generated_tokens", "Generated tokens per request", _linear(max_total_tokens)
        )
        self.request_input_length = hist(
            "tgi_request_input_length", "Input tokens per request", _linear(max_input_tokens)
        )
        self.request_max_new_tokens = hist(
            "tgi_request_max_new_tokens", "max_new_tokens per request", _linear(max_total_tokens)
        )
        # TGI's exporter renders un-bucketed histograms as summaries
        self.request_skipped_tokens = Summary(
            "tgi_request_skipped_tokens", "Speculated tokens per generation step", registry=r
        )
        self.queue_size = gauge("tgi_queue_size", "Requests waiting in the queue")
        self.batch_current_size = gauge("tgi_batch_current_size", "Requests in the running batch")
        self.batch_current_max_tokens = gauge("tgi_batch_current_max_tokens", "Tokens the running batch may reach")
        self.batch_max_total_tokens = gauge("tgi_batch_max_total_tokens", "Maximum tokens in the KV cache")
        self.batch_total_tokens = gauge("tgi_batch_total_tokens", "Maximum amount of tokens in total.")
        self.batch_next_size = hist(
            "tgi_batch_next_size", "Requests in the next batch", tuple(float(n) for n in range(1, 1025))
        )
        method = ["method"]
        self.batch_inference_count = counter("tgi_batch_inference_count", "Batch steps run", method)
        self.batch_inference_success = counter("tgi_batch_inference_success", "Batch steps succeeded", method)
        self.batch_inference_failure = counter("tgi_batch_inference_failure", "Batch steps failed", method)
        self.batch_inference_duration = hist("tgi_batch_inference_duration", "Batch step time (s)", labels=method)
        self.batch_forward_duration = hist("tgi_batch_forward_duration", "Forward pass time (s)", labels=method)
        self.batch_decode_duration = hist("tgi_batch_decode_duration", "Detokenization time (s)", labels=method)
        self.batch_filter_duration = hist("tgi_batch_filter_duration", "Batch filter time (s)", labels=method)
        self.batch_concat_duration = hist("tgi_batch_concat_duration", "Batch concat time (s)", labels=method)
        self.batch_concat = counter("tgi_batch_concat", "Batch concatenations", ["reason"])

        # Switchyard's own
        self.hop_queue_depth = gauge("switchyard_hop_queue_depth", "Messages waiting at a hop", ["hop"])
        self.hop_duration = hist(
            "switchyard_hop_duration_seconds", "Time a request spends in a hop (s)", labels=["hop"]
        )
        self.step_duration = hist(
            "switchyard_step_duration_seconds",
            "One model step, by phase: plan/forward/sample/publish (s)",
            labels=["phase"],
        )
        self.time_to_first_token = hist(
            "switchyard_time_to_first_token_seconds", "From the request read by http to its first token sent (s)"
        )
        self.inter_token_latency = hist(
            "switchyard_inter_token_latency_seconds", "Between two tokens of a stream, as http sends them (s)"
        )
        # SSE: events sent and the socket writes that carried them (services/http/sse_writer.py)
        self.sse_events = counter("switchyard_sse_events", "SSE events sent to clients")
        self.sse_writes = counter("switchyard_sse_writes", "Socket writes of SSE events (a step's events go in one)")
        self.kv_blocks_used = gauge("switchyard_kv_blocks_used", "KV cache blocks in use (all replicas)")
        self.kv_blocks_free = gauge("switchyard_kv_blocks_free", "KV cache blocks free (all replicas)")
        self.prefix_cache_queried_tokens = counter(
            "switchyard_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hit_tokens = counter("switchyard_prefix_cache_hit_tokens", "Prompt tokens found in the cache")
        self.speculative_draft_tokens = counter(
            "switchyard_speculative_draft_tokens", "Tokens drafted by prompt lookup and verified (--speculate)"
        )
        self.speculative_accepted_tokens = counter(
            "switchyard_speculative_accepted_tokens", "Drafted tokens accepted (each one a forward step saved)"
        )
        self.resyncs = counter(
            "switchyard_resyncs", "Streams asked again from offset 0 (rows lost), by asker and reason", ["by", "reason"]
        )
        self.grammar_compile_duration = hist(
            "switchyard_grammar_compile_seconds", "Compiling a request's grammar, by kind (s)", labels=["kind"]
        )
        self.constrained_rows = hist(
            "switchyard_constrained_rows", "Grammar-constrained rows per step", (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
        )
        self.request_images = hist(
            "switchyard_request_images", "Images per request to a vision model", (0, 1, 2, 3, 4, 6, 8, 16, 32)
        )
        self.image_preprocess_duration = hist(
            "switchyard_image_preprocess_seconds", "Fetching, decoding and preprocessing a request's images (s)"
        )
        self.image_encode_duration = hist(
            "switchyard_image_encode_seconds", "The vision tower and projector in a step that encoded images (s)"
        )
        self._tokenized = counter("switchyard_tokenized_tokens", "Tokens produced by a tokenizer process", ["index"])
        self._detokenized = counter(
            "switchyard_detokenized_tokens", "Tokens turned into text by a detokenizer", ["index"]
        )
        self.lora_requests = counter("switchyard_lora_requests", "Requests admitted, by LoRA adapter", ["adapter"])
        self.lora_generated_tokens = counter(
            "switchyard_lora_generated_tokens", "Tokens generated, by LoRA adapter", ["adapter"]
        )
        self.lora_adapters_loaded = gauge("switchyard_lora_adapters_loaded", "LoRA adapters served", ["replica"])
        # vLLM's names, which the Gateway API Inference Extension (and llm-d, KServe) route on: one series per
        # replica (engine = its index), set by its scheduler (docs/observability.md, "Gateway metrics")
        engine = ["model_name", "engine"]
        self.vllm_num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine
        )
        self.vllm_num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", engine
        )
        self.vllm_kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine
        )
        self.vllm_lora_requests_info = gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters", *engine],
        )
        self.vllm_cache_config_info = gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", *engine],
        )
        self.process_up = gauge("switchyard_process_up", "1 while the process heartbeats", ["role", "index"])
        self.process_restarts = counter("switchyard_process_restarts", "Restarts seen (a new pid)", ["role", "index"])
        self.process_up.labels(role=role, index=str(index)).set(1)
        # when the render a heartbeat carried was made: renders are paced, so a counter may lag its event by up to
        # two heartbeats, and a reader who must see an event's counts waits for a render made after it
        self._rendered = gauge(
            "switchyard_metrics_rendered_timestamp_seconds",
            "When this process's metrics, as sent with its heartbeat, were rendered (Unix time)",
            ["role", "index"],
        )
        # CPU seconds, RSS, fds of this process, labelled so the merge keeps processes apart
        self._objects = [v for v in vars(self).values() if isinstance(v, MetricWrapperBase)]
        self._process = _Labelled(ProcessCollector(namespace="switchyard", registry=None), role, index)
        r.register(self._process)
        # bucket bounds (with +Inf) of every histogram, labelled ones too: merge restores full layouts
        self.layouts = {o._name: tuple(o._upper_bounds) for o in self._objects if o._type == "histogram"}
        self.definitions = {fam.name: (fam.type, fam.documentation) for fam in self.registry.collect()}

    @property
    def tokenized_tokens(self):
        """This tokenizer process's token counter (switchyard_tokenized_tokens_total{index})."""
        return self._tokenized.labels(index=str(self.index))

    @property
    def detokenized_tokens(self):
        return self._detokenized.labels(index=str(self.index))

    def exposition(self) -> str:
        """The compact text a heartbeat carries (docs/observability.md)."""
        families: dict[str, promtext.Family] = {}
        for obj in self._objects:
            try:  # values read straight from the metric objects: collect() is far slower
                families[obj._name] = _fast_family(obj)
            except AttributeError:  # another prometheus_client layout: the slow, public way
                for fam in obj.collect():
                    families[fam.name] = promtext.compact(fam)
        for fam in self._process.collect():
            families[fam.name] = promtext.compact(fam)
        return promtext.render(families, {})


def _fast_family(obj) -> promtext.Family:
    kind = obj._type
    f = promtext.Family(kind)
    if obj._labelnames:
        with obj._lock:
            children = [(dict(zip(obj._labelnames, lv)), c) for lv, c in obj._metrics.items()]
    else:
        children = [({}, obj)]
    name = obj._name
    for labels, c in children:
        key = promtext.key_of(labels)
        if kind == "histogram":
            total, prev = 0.0, 0.0
            buckets = []
            for bound, b in zip(c._upper_bounds, c._buckets):
                total += b.get()
                if total != prev or bound == math.inf:
                    buckets.append((bound, total))
                prev = total
            if not labels and total == 0:
                continue
            for bound, v in buckets:
                f.samples[(name + "_bucket", key + (("le", floatToGoString(bound)),))] = v
            f.samples[(name + "_sum", key)] = c._sum.get()
            f.samples[(name + "_count", key)] = total
        elif kind == "summary":
            count = c._count.get()
            if labels or count:
                f.samples[(name + "_sum", key)] = c._sum.get()
                f.samples[(name + "_count", key)] = count
        else:
            value = c._value.get()
            if labels or value:
                f.samples[(name + "_total" if kind == "counter" else name, key)] = value
    return f


class Aggregator:
    """http's view for /metrics: the last metrics text of every process, merged with its own.

    Counters stay monotonic across restarts: a process that comes back with a new pid has its old
    last counters folded into a `retired` text, and a process that went quiet keeps contributing
    its last counters (not its gauges). `switchyard_process_up` is 0 for processes gone quiet, and
    `switchyard_process_restarts_total` counts new pids.
    """

    def __init__(self, role: str, index: int, stale_after: float = 3.0):
        self.me = (role, index)
        self.stale_after = stale_after
        self._last: dict[tuple[str, int], tuple[float, int, str]] = {}  # → (monotonic time, pid, text)
        self._retired: list[str] = []

    def observe(self, hb) -> None:
        """Record a Heartbeat (any object with role, index, pid, metrics)."""
        key = (hb.role, hb.index)
        if key == self.me:
            return  # our own registry is read fresh at render time
        old = self._last.get(key)
        if old is not None and old[1] != hb.pid:
            self._retired = [
                merge([*self._retired, promtext.counters_only(old[2])], definitions=promtext.NO_DEFINITIONS)
            ]
            m = get()
            if m is not None:
                m.process_restarts.labels(role=hb.role, index=str(hb.index)).inc()
        text = hb.metrics
        if not text and old is not None and old[1] == hb.pid:
            text = old[2]  # a heartbeat without metrics: unchanged since the last one (rate-limited)
        self._last[key] = (time.monotonic(), hb.pid, text)

    def render(self) -> str:
        now = time.monotonic()
        texts = list(self._retired)
        m = get()
        if m is not None:
            texts.append(m.exposition())
        down = []
        for (role, index), (seen, _pid, text) in self._last.items():
            if now - seen < self.stale_after:
                texts.append(text)
            else:
                texts.append(promtext.counters_only(text))
                down.append(f'switchyard_process_up{{index="{index}",role="{promtext.escape_label(role)}"}} 0')
        if down:
            texts.append("# TYPE switchyard_process_up gauge\n" + "\n".join(down) + "\n")
        return merge(texts)


_current: Metrics | None = None


def merge(texts: Iterable[str], definitions: Metrics | None = None) -> str:
    """`promtext.merge` with this process's metrics (`get()`) as the definitions by default: HELP
    lines, full bucket layouts, zeros for unlabelled metrics nobody recorded."""
    return promtext.merge(texts, definitions if definitions is not None else _current)


def init(role: str, index: int, settings=None) -> Metrics:
    """Create this process's metrics (once; a second call replaces them). `settings` (a Settings)
    gives TGI's linear bucket layouts (max_input_tokens, max_total_tokens)."""
    global _current
    kw = {}
    if settings is not None:
        kw = {"max_input_tokens": settings.max_input_tokens, "max_total_tokens": settings.max_total_tokens}
    _current = Metrics(role, index, **kw)
    return _current


def get() -> Metrics | None:
    """This process's metrics, or None before `init`."""
    return _current


def exposition() -> str:
    """This process's metrics text ("" before `init`)."""
    return _current.exposition() if _current is not None else ""


def heartbeat_exposition() -> str:
    """The metrics text a heartbeat carries, stamped with the time of its render ("" before `init`)."""
    if _current is None:
        return ""
    _current._rendered.labels(role=_current.role, index=str(_current.index)).set(time.time())
    return _current.exposition()


__all__ = ["Aggregator", "DURATION_BUCKETS", "Metrics", "exposition", "get", "heartbeat_exposition", "init", "merge"]
