"""--scheduling-policy priority in the batcher: lower priority values run first, a request that outranks the
worst running one preempts it (a full batch, or a full KV cache), the preempted resumes from its own tokens, equal
priorities stay first come, first served, and age bounds how long a request waits behind later ones."""

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import FINISH_NONE
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher
from services.scheduler.priority import PriorityOrder


def req(rid: str, priority: int = 0, prompt_len: int = 8, max_new: int = 4) -> Req:
    ids = np.arange(10, 10 + prompt_len, dtype=np.int32)
    return Req(
        request_id=rid,
        ingress=0,
        input_ids=ids,
        sampling=SamplingParams(priority=priority),
        max_new_tokens=max_new,
    )


def run_step(b: Batcher, n: int) -> tuple[list[str], list]:
    """Plan step n and apply a result: every sampled row's token is 100 + its offset. Returns the ids of the
    requests the plan ran and the plan."""
    plan = b.plan(n)
    ran = [b.running[s].req.request_id for s in plan.seqs.tolist()]
    rows = [(s, i) for i, s in enumerate(plan.seqs.tolist()) if plan.sample[i]]
    tokens = [100 + len(b.running[s].output) for s, _ in rows]
    res = StepResult(
        step=n,
        seqs=np.array([s for s, _ in rows], np.int32),
        token_ids=np.array(tokens, np.int32),
        logprobs=np.zeros(len(rows), np.float32),
    )
    b.apply(codec.decode(codec.encode(res)))
    return ran, plan


def drain(b: Batcher, start: int = 1) -> list[str]:
    """Run to the end; the order in which requests finished."""
    done, n = [], start
    while b.has_work():
        before = set(b.by_request)
        run_step(b, n)
        done += sorted(before - set(b.by_request))
        n += 1
    return done


def batcher(**kw) -> Batcher:
    kw = {"max_batch_size": 1, "max_batch_prefill_tokens": 64, "eos_ids": set(), "prefix_caching": False, **kw}
    return Batcher(kw.pop("num_blocks", 100), scheduling_policy="priority", **kw)


def test_equal_priority_is_first_come_first_served():
    b = batcher()
    for rid in "abcd":
        b.add(req(rid, priority=3))
    assert drain(b) == ["a", "b", "c", "d"]
    assert b.counters["priority_preemptions"] == 0 and b.counters["preemptions"] == 0


def test_waiting_requests_run_by_priority():
    b = batcher()
    b.add(req("a", priority=0))
    run_step(b, 1)  # a runs; the rest wait behind it (none outranks it)
    for rid, p in [("b", 5), ("c", 1), ("d", 1), ("e", 2)]:
        b.add(req(rid, priority=p))
    assert drain(b, 2) == ["a", "c", "d", "e", "b"]
    assert b.counters["priority_preemptions"] == 0


def test_fcfs_ignores_priority():
    b = Batcher(100, max_batch_size=1, max_batch_prefill_tokens=64, eos_ids=set())
    for rid, p in [("a", 5), ("b", -5)]:
        b.add(req(rid, priority=p))
    assert drain(b) == ["a", "b"]


def test_a_request_that_outranks_a_full_batch_preempts_the_worst_and_it_resumes_with_its_tokens():
    b = batcher(max_batch_size=2)
    b.add(req("low", priority=5, max_new=6))
    b.add(req("mid", priority=1, max_new=6))
    run_step(b, 1)
    run_step(b, 2)
    low = b.by_request["low"]
    assert low.output == [100, 101] and len(b.running) == 2  # the batch is full
    b.add(req("high", priority=-1, max_new=2))
    ran, plan = run_step(b, 3)
    assert b.counters["priority_preemptions"] == 1 and b.counters["preemptions"] == 1
    assert sorted(ran) == ["high", "mid"]  # the lowest-priority one gave way, in the same step
    assert low.seq in plan.finished  # the shard drops its KV
    assert list(b.waiting) == [low] and low.output == [100, 101]  # nothing it generated is lost
    ran, _ = run_step(b, 4)  # high's last token; low still waits (mid runs)
    assert "high" not in b.by_request and "low" not in ran
    ran, plan = run_step(b, 5)  # high is done: low is fed again from its own tokens (recompute)
    assert "low" in ran
    row = ran.index("low")
    start = int(plan.num_tokens[:row].sum())
    fed = plan.token_ids[start : start + int(plan.num_tokens[row])].tolist()
    assert fed == list(range(10, 18)) + [100, 101]  # prompt + what it had generated
    assert drain(b, 6) == ["mid", "low"]
    assert low.output == [100, 101, 102, 103, 104, 105]


def test_a_request_that_outranks_a_full_cache_preempts_the_worst():
    # 4 blocks of 16: two running prompts of 24 tokens take 2 blocks each; nothing else fits
    b = batcher(max_batch_size=8, num_blocks=4)
    b.watermark = 0
    b.add(req("low", priority=2, prompt_len=24, max_new=8))
    b.add(req("mid", priority=1, prompt_len=24, max_new=8))
    run_step(b, 1)
    assert len(b.running) == 2 and b.allocator.free == 0
    b.add(req("high", priority=0, prompt_len=24, max_new=2))
    ran, _ = run_step(b, 2)
    assert sorted(ran) == ["high", "mid"] and b.counters["priority_preemptions"] == 1
    assert [s.req.request_id for s in b.waiting] == ["low"]


def test_no_preemption_for_an_equal_or_lower_priority():
    b = batcher()
    b.add(req("a", priority=1))
    run_step(b, 1)
    b.add(req("b", priority=1))
    b.add(req("c", priority=4))
    ran, _ = run_step(b, 2)
    assert ran == ["a"] and b.counters["priority_preemptions"] == 0


def test_age_bounds_starvation():
    now = [0.0]
    b = batcher()
    b.priority = PriorityOrder(10.0, clock=lambda: now[0])  # one priority level per 10 s waited
    b.add(req("first", priority=0, max_new=50))
    run_step(b, 1)
    b.add(req("patient", priority=5))  # arrives at 0 s
    now[0] = 30.0
    b.add(req("later", priority=3))  # 30 s later, 2 levels better: still behind (5 + 0 < 3 + 3)
    now[0] = 70.0
    b.add(req("urgent", priority=-3))  # 70 s later, 8 levels better: ahead (5 + 0 > -3 + 7)
    assert [s.req.request_id for s in sorted(b.waiting, key=b.priority.key)] == ["urgent", "patient", "later"]
    assert drain(b, 2) == ["first", "urgent", "patient", "later"]


def test_row_after_preemption_keeps_streaming_offsets():
    b = batcher()
    b.add(req("low", priority=1, max_new=4))
    run_step(b, 1)
    b.add(req("high", priority=0, max_new=1))
    run_step(b, 2)  # high preempts low and finishes
    plan = b.plan(3)
    s = b.running[int(plan.seqs[0])]
    res = StepResult(step=3, seqs=plan.seqs, token_ids=np.array([7], np.int32), logprobs=np.zeros(1, np.float32))
    (row,) = b.apply(codec.decode(codec.encode(res)))
    assert s.req.request_id == "low" and row.offset == 1 and row.finish == FINISH_NONE  # offset 0 was streamed
