"""The rule that turns speculative drafting up and down (services/scheduler/speculative.py): the step-time model
fitted from the shard's `forward_s`, the per-row acceptance record, and what they decide together, driven through
the batcher by a simulated shard whose step time follows a CPU-like cost (a plain decode step, a position, and a
penalty for verifying any draft at all) and whose rows either copy (every draft is right) or write freely (none is).
"""

from __future__ import annotations

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import StepResult
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from services.scheduler import speculative
from services.scheduler.batcher import Batcher
from services.scheduler.speculative import RowStats, StepCost

EOS = 2
LOOP = [11, 12, 13, 14, 15, 16]  # a prompt that repeats itself: lookup always has a match


def cpu_step(positions: int, rows: int, drafted: bool) -> float:
    """Seconds of a decode step as measured on a 2-core CPU (SmolLM2-135M, bf16, busy): ~100 ms of weights' read,
    8 ms a position, and 3 ms a row once any draft is verified (attention leaves its one-query fast path)."""
    return 0.1 + 0.008 * positions + (0.003 * rows if drafted else 0.0)


class Shard:
    """Answers plans: a copying row's next tokens are its loop's (its drafts are right), a free-writing row's are
    the same words in a random order (lookup finds matches, and its drafts are mostly wrong); a drafted row keeps its
    right drafts plus one token."""

    def __init__(self, batcher: Batcher, copying: set[str], step_time=cpu_step) -> None:
        self.b, self.copying, self.step_time = batcher, copying, step_time
        self.rng = np.random.default_rng(0)
        self.drafted_steps: list[int] = []  # per step: drafts in it

    def truth(self, rid: str, index: int) -> int:
        return LOOP[index % len(LOOP)] if rid in self.copying else int(self.rng.choice(LOOP))  # free: matches, wrong

    def step(self, step: int) -> None:
        plan = self.b.plan(step)
        drafts = plan.drafts.tolist() or [0] * len(plan.seqs)
        seqs, counts, tokens, at = [], [], [], 0
        for seq, n, d in zip(plan.seqs.tolist(), plan.num_tokens.tolist(), drafts):
            s = self.b.running[seq]
            fed, at = plan.token_ids[at : at + n].tolist(), at + n
            if s.computed < s.total:
                continue  # a prefill chunk that does not sample
            kept = []
            for draft in [*fed[n - d :], None]:
                kept.append(self.truth(s.req.request_id, len(s.output) + len(kept)))
                if kept[-1] != draft:
                    break
            seqs.append(seq)
            counts.append(len(kept))
            tokens += kept
        self.drafted_steps.append(sum(drafts))
        res = StepResult(
            step=step,
            seqs=np.array(seqs, np.int32),
            token_counts=np.array(counts, np.int32),
            token_ids=np.array(tokens, np.int32),
            logprobs=np.zeros(len(tokens), np.float32),
            forward_s=self.step_time(len(plan.token_ids), len(plan.seqs), bool(sum(drafts))),
        )
        self.b.apply(codec.decode(codec.encode(res)))


def run(rows: int, copying: bool, steps: int, max_new: int = 400) -> tuple[Batcher, Shard]:
    b = Batcher(512, max_batch_size=64, max_batch_prefill_tokens=4096, eos_ids={EOS}, speculate=4)
    for i in range(rows):
        b.add(Req(request_id=f"r{i}", ingress=0, input_ids=np.asarray(LOOP * 3, np.int32),
                  sampling=SamplingParams(), max_new_tokens=max_new))  # fmt: skip
    shard = Shard(b, {f"r{i}" for i in range(rows)} if copying else set())
    for step in range(1, steps + 1):
        shard.step(step)
    return b, shard


def test_the_time_model_learns_a_step_and_the_price_of_drafting():
    cost = StepCost()
    assert cost.model() is None and cost.time(1, 1, False) > 0  # answers before any step was timed
    rng = np.random.default_rng(1)
    for _ in range(speculative.WINDOW):
        d = int(rng.choice([0, 0, 1, 4, 8]))
        cost.observe(16 + d, 16, bool(d), cpu_step(16 + d, 16, bool(d)) + rng.normal(0, 0.002))
    fixed, per_position, once, per_row = cost.model()
    assert abs(per_position - 0.008) < 0.002 and abs(once + 16 * per_row - 0.048) < 0.01
    assert abs(fixed - 0.1) < 0.03


def test_the_acceptance_record_follows_the_drafts_and_drifts_back_when_idle():
    stats = RowStats()
    assert stats.acceptance == speculative.PRIOR_P
    for _ in range(10):
        stats.observe(4, 0)  # the first draft rejected every time
    assert stats.acceptance < 0.1
    for _ in range(200):
        stats.idle()
    assert abs(stats.acceptance - speculative.PRIOR_P) < 0.05
    for _ in range(10):
        stats.observe(4, 4)
    assert stats.acceptance > 0.95


def test_one_copying_stream_drafts_fully():
    b, shard = run(rows=1, copying=True, steps=40)
    assert b.counters["draft_tokens"] > 0 and b.counters["accepted_tokens"] == b.counters["draft_tokens"]
    assert shard.drafted_steps[-20:] == [4] * 20  # the whole N every step, with the step's cost learnt
    assert b.counters["generated"] > 4 * 40  # ~5 tokens a step


def test_sixteen_free_writing_streams_do_not_draft():
    b, shard = run(rows=16, copying=False, steps=200)
    assert sum(shard.drafted_steps) <= 0.02 * 16 * len(shard.drafted_steps)  # at most a rare probe
    assert 0 < b.drafter.gain <= 1.0  # weighed, and found not to pay


def test_sixteen_copying_streams_draft_where_it_pays():
    """Rows known to copy (every draft right): 16 rows × 4 drafts pay on the CPU-like cost (tokens ×5 for ~3.5×
    the time), where the old flat budget (24 − rows) allowed 8 drafts; on a machine where verifying anything
    costs five plain steps, they do not, and nothing is drafted."""
    b, shard = run(rows=16, copying=True, steps=1)
    for s in b.running.values():
        s.drafting.accepted, s.drafting.rejected = 20.0, 0.0
    for step in range(2, 12):
        shard.step(step)
    assert shard.drafted_steps[-5:] == [64] * 5 and b.drafter.gain > 1.2
    b.drafter.cost = StepCost()
    for d in (0, 64, 0, 64):
        b.drafter.cost.observe(16 + d, 16, bool(d), 0.228 if not d else 5 * 0.228 + 0.008 * d)
    before = b.counters["draft_tokens"]
    shard.step(12)
    assert b.counters["draft_tokens"] == before and b.drafter.gain <= 1.0


def test_a_row_that_turns_to_copying_drafts_again():
    """A row whose drafts failed for a while falls to probing on two-token matches; when its text turns to a copy
    it is noticed and drafts the whole N again (not left off for good)."""
    b, shard = run(rows=1, copying=False, steps=60)
    s = next(iter(b.running.values()))
    assert s.drafting.acceptance < 0.3
    shard.copying.add(s.req.request_id)  # from now on the row repeats its loop
    for step in range(61, 121):
        shard.step(step)
    assert shard.drafted_steps[-10:] == [4] * 10 and s.drafting.acceptance > 0.9
