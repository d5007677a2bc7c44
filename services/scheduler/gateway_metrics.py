"""The replica's load under vLLM's metric names, which the Kubernetes Gateway API Inference Extension's model-server
protocol (and llm-d, KServe) read to pick a replica: queue depth, running requests, KV-cache use, and the LoRA
adapters of its running and waiting requests. Read from the Batcher's public state each heartbeat; the mapping is
in docs/observability.md ("Gateway metrics")."""

from __future__ import annotations

import time

from libs.runtime import metrics


class GatewayGauges:
    def __init__(self, batcher, *, model_name: str, engine: int, max_loras: int, block_size: int):
        self.batcher = batcher
        self.m = metrics.get()
        if self.m is None:
            raise RuntimeError("metrics.init() comes first (service.run does it)")
        self.labels = {"model_name": model_name, "engine": str(engine)}
        self.max_lora = str(max_loras)
        # an info gauge (always 1), as vLLM's: the EPP's prefix scorer reads the block size and pool from its labels
        pool = str(batcher.allocator.num_blocks)
        self.m.vllm_cache_config_info.labels(block_size=str(block_size), num_gpu_blocks=pool, **self.labels).set(1)

    def update(self) -> None:
        m, b = self.m, self.batcher
        m.vllm_num_requests_waiting.labels(**self.labels).set(len(b.waiting))
        m.vllm_num_requests_running.labels(**self.labels).set(len(b.running))
        total = b.allocator.num_blocks
        # vLLM's usage: 1 - free/total, where a cached block no request holds counts as free (it can be evicted)
        m.vllm_kv_cache_usage_perc.labels(**self.labels).set(1.0 - b.allocator.free / total if total else 0.0)
        # vLLM's rule: adapter names with running / waiting requests, comma-joined; the value is when this was
        # last updated, so a reader takes the newest series. Only the current label set is kept.
        running = sorted({s.req.adapter for s in b.running.values() if s.req.adapter})
        waiting = sorted({s.req.adapter for s in b.waiting if s.req.adapter})
        info = m.vllm_lora_requests_info
        info.clear()
        info.labels(
            max_lora=self.max_lora,
            waiting_lora_adapters=",".join(waiting),
            running_lora_adapters=",".join(running),
            **self.labels,
        ).set(time.time())
