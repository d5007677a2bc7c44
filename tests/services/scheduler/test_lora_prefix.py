"""LoRA adapters in the scheduler: KV depends on the adapter, so the prefix cache and the router's prefix affinity
key blocks by adapter; a sequence's adapter travels to the shard in its NewSequence (no model)."""

import numpy as np

from libs.protocol.messages import Heartbeat
from libs.protocol.prefix_hash import prefix_hashes
from services.router.placement import Placement
from services.scheduler.batcher import Batcher
from tests.services.scheduler.test_prefix_preempt import EOS, req, result


def _with(r, adapter):
    r.adapter = adapter
    return r


def test_a_prefix_serves_only_its_own_adapter():
    b = Batcher(40, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    b.add(req("base", prompt, 1))
    p = b.plan(1)
    assert p.new[0].adapter is None
    b.apply(result(p))  # the base model's 3 blocks stay cached
    b.add(_with(req("a1", prompt, 1), "a"))
    p = b.plan(2)
    assert p.new[0].adapter == "a" and p.context_lens.tolist() == [0]  # the base prefix is not a's KV
    assert b.counters["lora_prefix_hit_tokens"] == 0 and b.counters["prefix_hit_tokens"] == 0
    b.apply(result(p))
    assert b.counters["lora_generated"] == 1
    b.add(_with(req("b1", prompt, 1), "b"))  # nor is a's KV b's
    b.add(_with(req("a2", prompt, 1), "a"))  # but a's prefix serves a
    b.add(req("base2", prompt, 1))  # and the base one the base model
    p = b.plan(3)
    rows = {n.adapter: int(c) for n, c in zip(p.new, p.context_lens.tolist())}
    assert rows == {"b": 0, "a": 12, None: 12}
    assert b.counters["lora_prefix_hit_tokens"] == 12 and b.counters["prefix_hit_tokens"] == 24


def test_hashes_and_affinity_include_the_adapter():
    ids = np.arange(40, dtype=np.int32)
    base, a, b = (prefix_hashes(ids, 16, adapter) for adapter in (None, "a", "b"))
    assert len(base) == len(a) == 2 and not set(base) & set(a) and not set(a) & set(b)
    assert prefix_hashes(ids, 16, "a") == a  # deterministic: router and scheduler agree
    hbs = [Heartbeat(role="scheduler", index=i, pid=1) for i in range(2)]
    placement = Placement()
    first = placement.choose_replica(ids, hbs, "a")
    placement.observe(hbs[first])  # its load is counted again from the heartbeat
    assert placement.choose_replica(ids, hbs, "a") == first  # the adapter's prefix lives there
    # the base model's prefix is unknown: least loaded (the other replica, which took nothing yet)
    assert placement.choose_replica(ids, hbs, None) == 1 - first
