"""Block reference counts and the prefix index, TGI's waiting knobs, preemption bookkeeping (no model)."""

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher
from services.scheduler.block_allocator import BlockAllocator

EOS = 2


def req(rid, ids, max_new=4, **sampling) -> Req:
    ids = np.asarray(ids, np.int32)
    return Req(request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(**sampling), max_new_tokens=max_new)


def result(plan, token=7) -> StepResult:
    seqs = plan.seqs[plan.sample.astype(bool)]
    res = StepResult(
        step=plan.step, seqs=seqs, token_ids=np.full(len(seqs), token, np.int32), logprobs=np.zeros(len(seqs))
    )
    return codec.decode(codec.encode(res))  # as the scheduler receives it: every frame an array


def test_refcounts_lru_and_eviction():
    a = BlockAllocator(3)
    x, y = a.allocate(2)
    a.register(x, b"hx")
    a.acquire([x])  # a second holder
    a.release([x, y])
    assert a.free == 2 and a.lookup([b"hx"]) == [x]  # still held once
    a.release([x])
    assert a.free == 3 and a.cached == 1 and a.unheld([x]) == 1  # cached, unheld, counted as free
    assert a.lookup([b"hx", b"nope"]) == [x]
    a.allocate(2)  # the free blocks go first: the cached one survives
    assert a.lookup([b"hx"]) == [x]
    a.allocate(1)  # then it is evicted (LRU)
    assert a.lookup([b"hx"]) == [] and a.cached == 0 and a.free == 0


def test_second_prompt_skips_the_cached_prefix():
    b = Batcher(20, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    b.add(req("a", prompt, 1))
    p = b.plan(1)
    b.apply(result(p))  # a finishes; its 3 full blocks stay cached
    b.add(req("b", prompt + [99, 98]))
    p = b.plan(2)
    assert p.context_lens.tolist() == [12] and p.token_ids.tolist() == [22, 99, 98]
    assert b.counters["prefix_hit_tokens"] == 12 and b.counters["prefix_queried_tokens"] == 12 + 12
    assert len(p.blocks[int(p.seqs[0])]) == 4  # 3 shared + 1 new
    assert p.new[0].prefix_ids == []  # no penalties: the shard needs no history
    b.add(req("c", prompt, repetition_penalty=1.3))  # everything cached but the last token, which is fed
    b.add(req("d", prompt, prompt_logprobs=True))  # wants prompt logprobs: fed in full, no lookup
    b.apply(result(p))
    p = b.plan(3)
    rows = dict(zip(p.seqs.tolist(), zip(p.context_lens.tolist(), p.num_tokens.tolist())))
    c, d = (n.seq for n in p.new)
    assert rows[c] == (12, 1) and rows[d] == (0, 13)
    assert p.new[0].prefix_ids == prompt[:12]


def test_a_late_request_joins_at_the_next_step_by_default():
    """TGI v3's chunking path: no waiting_served_ratio gate (one late request among 4 running used to wait 20
    steps, which was the bench's TTFT p90 at 16 streams)."""
    b = Batcher(200, max_batch_size=16, max_batch_prefill_tokens=512, eos_ids={EOS})
    for i in range(4):
        b.add(req(f"r{i}", [5, 6, 7], 100))
    b.apply(result(b.plan(1)))
    b.add(req("late", [5, 6], 100))
    p = b.plan(2)
    assert len(p.new) == 1 and p.num_tokens.tolist() == [1, 1, 1, 1, 2]
    assert b.counters["joined_steps"] == 1


def test_waiting_served_ratio_and_max_waiting_tokens():
    """TGI's gate without chunking, when asked for."""
    b = Batcher(200, max_batch_size=16, max_batch_prefill_tokens=512, eos_ids={EOS}, max_waiting_tokens=3,
                waiting_served_ratio=1.2)  # fmt: skip
    for i in range(4):
        b.add(req(f"r{i}", [5, 6, 7], 100))
    b.apply(result(b.plan(1)))  # 4 running: a join needs floor(4 * 1.2) = 4 waiting requests that fit
    b.add(req("late", [5, 6], 100))
    for step in (2, 3):
        p = b.plan(step)
        assert not p.new
        b.apply(result(p))
    p = b.plan(4)  # the third step since the last join: max_waiting_tokens lets it in alone
    assert [n.seq for n in p.new] and b.counters["joined_steps"] == 1


def test_preemption_frees_the_newest_and_resumes_without_repeating():
    b = Batcher(8, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    b.add(req("old", list(range(10, 18)), 20))  # 2 blocks now, 7 at the end: both cannot finish together
    b.add(req("new", list(range(30, 37)), 20))
    p = b.plan(1)
    old, new = p.seqs.tolist()
    step, emitted = 1, {"old": [], "new": []}
    while not b.counters["preemptions"]:
        for row in b.apply(result(p, token=50 + step)):
            emitted[row.seq.req.request_id].append(row.offset)
        step += 1
        p = b.plan(step)
    assert new in p.finished and list(b.waiting)[0].req.request_id == "new"  # the newest went back, first in line
    while b.has_work():
        for row in b.apply(result(p, token=50 + step)):
            emitted[row.seq.req.request_id].append(row.offset)
        step += 1
        p = b.plan(step)
        if p is not None and p.new:  # readmitted: fed prompt + generated, from its cached full blocks on
            s = b.running[p.new[0].seq]
            i = p.seqs.tolist().index(s.seq)
            fed = p.token_ids[sum(p.num_tokens[:i]) :][: p.num_tokens[i]].tolist()
            assert p.context_lens[i] + len(fed) == s.total and fed[-1] == s.output[-1]
    assert emitted == {"old": list(range(20)), "new": list(range(20))}  # nothing streamed twice or skipped
    assert b.allocator.free == 8


def test_a_join_never_evicts_the_cached_blocks_a_later_join_hits():
    """Requests admitted in one step: the first one's new blocks may evict cached blocks, but never those the second
    one's prefix hit takes (its hits are held before anything is allocated)."""
    b = Batcher(8, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids={EOS}, block_size=4)
    x, y = list(range(100, 109)), list(range(200, 209))  # 9 tokens each: two full blocks cached when they end
    for rid, ids in (("x", x), ("y", y)):
        b.add(req(rid, ids, max_new=1))
        b.apply(result(b.plan(b.counters["steps"] + 1)))
    assert b.allocator.cached == 4 and b.allocator.free == 8  # LRU: x's two blocks oldest, then y's
    b.add(req("a", range(300, 320), max_new=1))  # 5 new blocks: more than the 4 never-cached ones
    b.add(req("again", x, max_new=1))  # hits x's two blocks
    plan = b.plan(3)
    blocks = {b.running[s].req.request_id: b.running[s].blocks for s in plan.seqs.tolist()}
    assert not set(blocks["a"]) & set(blocks["again"]), blocks
    assert b.counters["prefix_hit_tokens"] == 8
