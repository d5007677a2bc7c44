"""The gateway gauges under vLLM's names, read from a real Batcher as it admits, runs and queues requests; checked
in the text /metrics serves (the merge http does), so names, types and labels are the ones a gateway parses."""

from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from libs.protocol.messages import TokenizedRequest
from libs.protocol.params import SamplingParams
from libs.runtime import metrics
from services.scheduler.batcher import Batcher
from services.scheduler.gateway_metrics import GatewayGauges


def req(rid: str, adapter: str | None = None) -> TokenizedRequest:
    ids = np.arange(10, 26, dtype=np.int32)  # one full block
    return TokenizedRequest(
        request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(), max_new_tokens=8, adapter=adapter
    )


def scrape() -> dict[str, list]:
    text = metrics.merge([metrics.exposition()])
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def test_gateway_gauges_follow_the_batch():
    metrics.init("scheduler", 3)
    b = Batcher(10, max_batch_size=2, max_batch_prefill_tokens=512, eos_ids=set(), prefix_caching=False)
    g = GatewayGauges(b, model_name="tiny", engine=3, max_loras=4, block_size=16)
    g.update()
    got = scrape()
    labels = {"model_name": "tiny", "engine": "3"}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        kind, samples = got[name]
        assert kind == "gauge" and [(s.labels, s.value) for s in samples] == [(labels, 0.0)]
    _, (cfg,) = got["vllm:cache_config_info"]
    assert cfg.labels == {"block_size": "16", "num_gpu_blocks": "10", **labels} and cfg.value == 1

    b.add(req("a", "sql"))
    b.add(req("b"))
    b.add(req("c", "chat"))
    b.plan(1)  # two fit the batch (max_batch_size 2), one waits
    g.update()
    got = scrape()
    assert got["vllm:num_requests_running"][1][0].value == 2
    assert got["vllm:num_requests_waiting"][1][0].value == 1
    # two prompts of 16 tokens: one block each, of 10
    assert abs(got["vllm:kv_cache_usage_perc"][1][0].value - 0.2) < 1e-9
    kind, (info,) = got["vllm:lora_requests_info"]
    assert kind == "gauge"
    assert info.labels == {"max_lora": "4", "running_lora_adapters": "sql", "waiting_lora_adapters": "chat", **labels}
    first = info.value
    assert first > 1.7e9  # a wall-clock timestamp, as vLLM sets it

    b.finish("a")
    b.plan(2)  # "c" takes the freed place
    g.update()
    _, (info,) = scrape()["vllm:lora_requests_info"]  # only the current label set is exported
    assert info.labels["running_lora_adapters"] == "chat" and info.labels["waiting_lora_adapters"] == ""
    assert info.value >= first
