"""The prefix-cache counters count each admitted prompt once: a head looked up in steps that admit nothing (it
waits for --waiting-served-ratio here) is not counted again."""

from services.scheduler.batcher import Batcher
from tests.services.scheduler.test_prefix_preempt import EOS, req, result


def test_a_waiting_head_is_counted_once():
    b = Batcher(40, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4,
                waiting_served_ratio=2.0, max_waiting_tokens=3)  # fmt: skip
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks before the last
    b.add(req("a", prompt, 20))
    b.apply(result(b.plan(1)))  # a runs and caches its 3 blocks
    b.add(req("b", prompt, 1))
    waited = 0
    for step in range(2, 10):
        p = b.plan(step)
        if p.new:  # b admitted
            break
        waited += 1
        b.apply(result(p))
    assert waited >= 2  # b was looked up in steps that did not admit it
    assert b.counters["prefix_queried_tokens"] == 24 and b.counters["prefix_hit_tokens"] == 12
