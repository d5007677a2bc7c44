"""Sibling sequences (the `n` choices of one request): the first prefills the prompt, the others fork its full
prompt blocks and feed only the prompt's tail; they wait while the first is still planning those blocks; every
block goes back once all of them end, preempted ones included."""

import numpy as np
import pytest

from libs.protocol import codec
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from services.scheduler.batcher import Batcher
from tests.services.scheduler.test_batcher import result

EOS = 2


def sibling(rid: str, prompt_len: int, max_new: int, group: str = "g", **sampling) -> Req:
    ids = np.arange(10, 10 + prompt_len, dtype=np.int32)
    return Req(
        request_id=rid,
        ingress=0,
        input_ids=ids,
        sampling=SamplingParams(**sampling),
        max_new_tokens=max_new,
        group=group,
    )


def rows_of(plan) -> dict[int, tuple[int, int]]:
    """seq → (context length, tokens fed)."""
    return {s: (c, n) for s, c, n in zip(plan.seqs.tolist(), plan.context_lens.tolist(), plan.num_tokens.tolist())}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_siblings_fork_the_first_ones_prompt_blocks(prefix_caching):
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, prefix_caching=prefix_caching)
    for i in range(4):
        b.add(sibling(f"r{i}", 40, 3))  # two full blocks and a tail of 8
    p1 = b.plan(1)
    assert p1.num_tokens.tolist() == [40]  # only the first: the others wait for its blocks
    leader = int(p1.seqs[0])
    b.apply(result(p1, {leader: 7}))
    p2 = b.plan(2)
    rows = rows_of(p2)
    others = [s for s in rows if s != leader]
    assert rows[leader] == (40, 1) and len(others) == 3
    assert all(rows[s] == (32, 8) for s in others)  # the tail only: 32 prompt tokens forked
    head = p1.blocks[leader][:2]
    assert all(p2.blocks[s][:2] == head for s in others)
    assert b.counters["sibling_shared_tokens"] == 3 * 32
    assert b.counters["prefill_rows"] == 4
    b.apply(result(p2, {s: 5 for s in p2.seqs.tolist()}))
    for step in range(3, 8):  # run every sibling to its length
        p = b.plan(step)
        if p is None:
            break
        b.apply(result(p, {s: 5 for s in p.seqs.tolist()}))
    assert not b.has_work()
    assert b.allocator.free == 100  # every shared block given back once, by its last holder


def test_a_sibling_waits_while_the_first_chunks_its_prompt():
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=32, eos_ids={EOS})
    b.add(sibling("a", 60, 2))
    b.add(sibling("b", 60, 2))
    p1 = b.plan(1)
    assert p1.num_tokens.tolist() == [32]
    b.apply(result(p1, {}))
    p2 = b.plan(2)
    assert p2.num_tokens.tolist() == [28]  # the first's last chunk; "b" still waits
    b.apply(result(p2, {int(p2.seqs[0]): 7}))
    p3 = b.plan(3)
    assert sorted(rows_of(p3).values()) == [(48, 12), (60, 1)]
    assert b.counters["sibling_shared_tokens"] == 48


def test_other_groups_and_prompt_logprobs_prefill_on_their_own():
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS})
    b.add(sibling("a", 40, 2))
    b.add(sibling("x", 40, 2, group="other"))  # another request's: not a sibling of "a"
    p1 = b.plan(1)
    assert p1.num_tokens.tolist() == [40, 40]
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS})
    b.add(sibling("a", 40, 2))
    b.add(sibling("b", 40, 2, prompt_logprobs=True))  # every prompt position must be scored by its own row
    p1 = b.plan(1)
    assert p1.num_tokens.tolist() == [40, 40]
    assert b.counters["sibling_shared_tokens"] == 0


def test_preempted_siblings_fork_again_and_give_every_block_back():
    # 8 blocks: four siblings of 40 tokens (3 blocks alone, 1 of their own each once forked) press the cache
    b = Batcher(8, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS})
    for i in range(4):
        b.add(sibling(f"r{i}", 40, 30))
    for step in range(1, 200):
        p = b.plan(step)
        if p is None:
            break
        b.apply(result(p, {s: 5 for s, last in zip(p.seqs.tolist(), p.sample.tolist()) if last}))
    assert not b.has_work()
    assert b.counters["preemptions"] > 0
    assert b.counters["sibling_shared_tokens"] > 3 * 32  # forked again after a preemption
    assert b.allocator.free == 8


def test_a_group_field_travels_on_the_wire():
    back = codec.decode(codec.encode(sibling("a", 4, 1)))
    assert back.group == "g"


def test_siblings_of_a_one_token_request_find_the_first_ones_blocks_cached():
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS})
    for i in range(3):
        b.add(sibling(f"r{i}", 40, 1))
    p1 = b.plan(1)
    assert p1.num_tokens.tolist() == [40]
    b.apply(result(p1, {int(p1.seqs[0]): 7}))  # its one token: it ends with its prefill
    p2 = b.plan(2)
    assert p2.num_tokens.tolist() == [8, 8] and p2.context_lens.tolist() == [32, 32]
    assert b.counters["sibling_shared_tokens"] == 2 * 32
