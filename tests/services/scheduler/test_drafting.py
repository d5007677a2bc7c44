"""Drafting in the scheduler (services/scheduler/drafting.py) and what the batcher does with a drafted row's
result: several tokens appended, stops at the first EOS / length, accepted drafts' KV counted and indexed, the
blocks past them freed (and the shard told), and the rule that turns drafting down when it does not pay."""

from __future__ import annotations

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import FINISH_EOS, FINISH_LENGTH, FINISH_NONE
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher
from services.scheduler.drafting import MAX_MATCH, PromptIndex, lookup

EOS = 2
LOOP = [11, 12, 13, 14, 15, 16]  # a prompt that repeats itself: lookup always has a match
TEN = list(range(11, 21))


def req(rid: str, prompt: list[int], max_new: int, grammar: str = "") -> Req:
    ids = np.asarray(prompt, np.int32)
    return Req(
        request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(), max_new_tokens=max_new, grammar=grammar
    )


def batcher(speculate: int = 4, blocks: int = 64, prefill: int = 256, **kw) -> Batcher:
    b = Batcher(blocks, max_batch_size=32, max_batch_prefill_tokens=prefill, eos_ids={EOS}, speculate=speculate, **kw)
    if b.drafter:  # positions cost nothing here (the rule is tested in test_speculative_policy.py): drafts are taken
        for positions in (1, 2, 9, 17, 25) * 6:
            b.drafter.cost.observe(positions, 1, positions > 1, 1.0)
    return b


def result(plan, tokens: dict[int, list[int]]) -> StepResult:
    """The shard's answer: per sampled row its tokens (several for a drafted row: accepted drafts + one)."""
    seqs = [s for s in plan.seqs.tolist() if s in tokens]
    flat = [t for s in seqs for t in tokens[s]]
    res = StepResult(
        step=plan.step,
        seqs=np.array(seqs, np.int32),
        token_counts=np.array([len(tokens[s]) for s in seqs], np.int32),
        token_ids=np.array(flat, np.int32),
        logprobs=np.zeros(len(flat), np.float32),
    )
    return codec.decode(codec.encode(res))


def drafts_of(plan) -> dict[int, list[int]]:
    """seq → the drafts its row carries (the fed tokens after the first)."""
    out, at = {}, 0
    for seq, n, d in zip(plan.seqs.tolist(), plan.num_tokens.tolist(), plan.drafts.tolist() or [0] * len(plan.seqs)):
        if d:
            out[seq] = plan.token_ids[at + n - d : at + n].tolist()
        at += n
    return out


def test_lookup_takes_the_longest_most_recent_match():
    assert lookup(np.array([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]), 3) == [9, 2, 3]  # "1 2 3" beats "2 3"
    assert lookup(np.array([5, 6, 1, 5, 7, 5]), 2) == [7, 5]  # the most recent "5"
    assert lookup(np.array([1, 2, 3, 4]), 3) == []  # nothing repeats
    assert lookup(np.array([4, 4]), 5) == [4]  # what follows, up to the end


def scan(tokens: list[int], k: int) -> tuple[list[int], int]:
    """Prompt lookup by brute force: the longest suffix (3, 2, 1 tokens) whose most recent earlier occurrence has
    something after it, and how far back that occurrence agrees with the suffix."""
    size = len(tokens)
    for n in range(min(3, size - 1), 0, -1):
        starts = [i for i in range(size - n) if tokens[i : i + n] == tokens[size - n :]]
        if starts:
            at, length = starts[-1], n
            while length < MAX_MATCH and at - (length - n) > 0 and tokens[at - (length - n) - 1] == tokens[-length - 1]:
                length += 1
            return tokens[at + n : at + n + k], length
    return [], 0


def test_the_row_index_grown_token_by_token_answers_as_a_scan():
    rng = np.random.default_rng(3)
    for _ in range(40):
        tokens = rng.integers(0, 5, 80).tolist()
        index = PromptIndex()
        index.extend(tokens[:20])  # the prompt, then one or a few tokens a step
        at = 20
        while at < len(tokens):
            at = min(len(tokens), at + int(rng.integers(1, 4)))
            index.extend(tokens[len(index.tokens) : at])
            assert index.propose(4) == scan(tokens[:at], 4)
    copy = list(range(30, 60))
    assert lookup(copy + copy[:20], 4) == copy[20:24]
    index = PromptIndex()
    index.extend(copy + copy[:20])
    assert index.propose(4)[1] == MAX_MATCH  # a copy matches far back; free writing mostly 1-3 tokens


def test_a_drafted_row_feeds_its_drafts_and_takes_several_tokens():
    b = batcher()
    b.add(req("a", LOOP * 3, 20))
    p1 = b.plan(1)
    a = int(p1.seqs[0])
    b.apply(result(p1, {a: [11]}))  # the loop goes on: lookup proposes 12 13 14 15
    p2 = b.plan(2)
    assert drafts_of(p2) == {a: [12, 13, 14, 15]} and p2.num_tokens.tolist() == [5]
    assert p2.context_lens.tolist() == [18] and p2.token_ids.tolist() == [11, 12, 13, 14, 15]
    rows = b.apply(result(p2, {a: [12, 13, 99]}))  # two accepted, the third differs
    assert [(r.offset, r.token_id, r.finish) for r in rows] == [(1, 12, 0), (2, 13, 0), (3, 99, 0)]
    s = b.running[a]
    assert s.output == [11, 12, 13, 99] and s.computed == s.total - 1 == 21  # 11 12 13 are in the KV
    assert b.counters["draft_tokens"] == 4 and b.counters["accepted_tokens"] == 2
    assert b.step_accepted == [2]
    p3 = b.plan(3)
    assert p3.context_lens.tolist() == [21] and p3.token_ids[0] == 99  # feeds on from the last accepted token


def test_eos_and_length_stop_at_the_first_token_that_ends():
    b = batcher()
    b.add(req("a", LOOP * 3, 20))
    b.add(req("b", LOOP * 3 + [11], 3))
    p1 = b.plan(1)
    a, c = p1.seqs.tolist()
    b.apply(result(p1, {a: [11], c: [12]}))
    p2 = b.plan(2)
    assert drafts_of(p2) == {a: [12, 13, 14, 15], c: [13]}  # c may draft only 1: 3 − 1 generated − the bonus
    rows = b.apply(result(p2, {a: [12, EOS, 14, 15, 16], c: [13, 14]}))
    assert [(r.seq.req.request_id, r.offset, r.token_id, r.finish) for r in rows] == [
        ("a", 1, 12, FINISH_NONE),
        ("a", 2, EOS, FINISH_EOS),  # the tokens after EOS are dropped
        ("b", 1, 13, FINISH_NONE),
        ("b", 2, 14, FINISH_LENGTH),
    ]
    assert not b.running and b.allocator.free == b.allocator.num_blocks


def test_rejected_drafts_free_their_blocks_and_the_next_plan_trims_the_shard():
    b = batcher(speculate=8, block_size=4, blocks=32)
    b.add(req("a", TEN + TEN[:5], 30))  # 15 tokens
    p1 = b.plan(1)
    a = int(p1.seqs[0])
    b.apply(result(p1, {a: [16]}))  # 14 15 16 was seen: 17 … 20 11 … 14 follow
    p2 = b.plan(2)
    assert len(drafts_of(p2)[a]) == 8 and len(b.running[a].blocks) == 6  # 16 + 8 slots: two more blocks
    b.apply(result(p2, {a: [99]}))  # every draft rejected
    assert len(b.running[a].blocks) == 5  # the next token's slot (17th) is in block 5
    p3 = b.plan(3)
    assert p3.trim == {a: 5} and p3.context_lens.tolist() == [16]


def test_prefix_index_holds_accepted_tokens_only():
    b = batcher(speculate=8, block_size=4, blocks=32)
    b.add(req("a", TEN + TEN[:2], 30))  # 12 tokens: three full blocks
    p1 = b.plan(1)
    a = int(p1.seqs[0])
    b.apply(result(p1, {a: [13]}))
    assert b.allocator.cached == 3
    p2 = b.plan(2)  # feeds 13 at position 12, then 8 drafts at 13..20
    assert len(drafts_of(p2)[a]) == 8
    b.apply(result(p2, {a: [14, 77]}))  # one accepted: the KV holds positions 0..13, block 3 is not full
    assert b.running[a].computed == 14 and b.allocator.cached == 3


def test_grammar_rows_draft_like_any_other():
    """The shard masks a grammar row's picks after its drafts (tests/services/shard/test_verify.py), so it drafts."""
    b = batcher()
    b.add(req("g", LOOP * 3, 20, grammar='{"type": "object"}'))
    p1 = b.plan(1)
    g = int(p1.seqs[0])
    b.apply(result(p1, {g: [11]}))
    assert b.plan(2).drafts.tolist() == [4] and b.counters["draft_tokens"] == 4


def test_no_drafts_without_speculate():
    b = batcher(speculate=0)
    b.add(req("a", LOOP * 3, 20))
    p1 = b.plan(1)
    b.apply(result(p1, {int(p1.seqs[0]): [11]}))
    assert b.plan(2).drafts.tolist() == [] and b.drafter is None
