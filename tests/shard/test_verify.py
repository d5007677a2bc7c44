"""The shard's verification of drafted tokens (services/shard/verify.py) on the tiny models.

A small driver feeds decode rows as [last token, d1..dk] with drafts that are partly right and partly wrong (taken
from the answer itself, then spoiled), so both the accept and the reject paths run: greedy output must still equal
transformers' generate() token for token, and a seeded sampled request (with a repetition penalty, whose history
must drop rejected drafts) must yield the same tokens, logprobs and alternatives as without drafts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from libs.protocol import codec
from libs.protocol.messages import NewSequence, StepPlan
from libs.protocol.params import SamplingParams
from services.scheduler.batcher import Batcher
from services.scheduler.drafting import MAX_MATCH, Drafter
from services.shard.model_runner import ModelRunner
from services.shard.sampling.sampler import Choice
from services.shard.verify import accept, kept_positions, select
from services.tokenizer.grammar import grammar_text
from tests.reference import reference_generate
from tests.shard.driver import prompts_for
from tests.shard.test_engine_loop import request, serve
from tests.tiny_models import EOS

DraftFn = Callable[[int, list[int]], list[int]]  # (seq, its output so far) → drafts


def drive_drafted(runner: ModelRunner, prompts, max_new, sampling, drafter: DraftFn | None, grammars=None):
    """Every sequence joins at step 1 (with its grammar, if `grammars` gives one); decode rows carry the drafter's
    tokens. Returns per seq its tokens, logprobs, alternatives, and the (drafted, accepted) totals."""
    bs = runner.block_size
    free = list(range(runner.num_blocks))[::-1]
    out = {i: [] for i in range(len(prompts))}
    lps = {i: [] for i in range(len(prompts))}
    tops = {i: [] for i in range(len(prompts))}
    ctx = dict.fromkeys(out, 0)
    owned = {i: [] for i in out}
    drafted = accepted = 0
    step, finished = 0, []
    new = [NewSequence(i, sampling[i], grammar=(grammars or {}).get(i, "")) for i in out]
    while ctx:
        step += 1
        rows, blocks = [], {}
        for seq in sorted(ctx):
            if ctx[seq] == 0:
                fed, d = prompts[seq], 0
            else:
                room = max_new - len(out[seq]) - 1
                drafts = (drafter(seq, out[seq]) if drafter else [])[: max(room, 0)]
                fed, d = [out[seq][-1], *drafts], len(drafts)
            need = -(-(ctx[seq] + len(fed)) // bs) - len(owned[seq])
            if need > 0:
                blocks[seq] = [free.pop() for _ in range(need)]
                owned[seq] += blocks[seq]
            rows.append((seq, fed, d))
        plan = StepPlan(
            step=step,
            new=new,
            blocks=blocks,
            finished=finished,
            seqs=np.array([r[0] for r in rows], np.int32),
            num_tokens=np.array([len(r[1]) for r in rows], np.int32),
            context_lens=np.array([ctx[r[0]] for r in rows], np.int32),
            token_ids=np.array([t for r in rows for t in r[1]], np.int32),
            sample=np.ones(len(rows), np.uint8),
            drafts=np.array([r[2] for r in rows], np.int32),
        )
        plan.check()
        new, finished = [], []
        result = codec.decode(codec.encode(runner.execute(plan)))
        counts = result.token_counts.tolist() or [1] * len(result.seqs)
        tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        top_counts, top_ids = result.top_counts.tolist(), result.top_ids.tolist()
        at = alt = 0
        for (seq, fed, d), n in zip(rows, counts):
            assert 1 <= n <= d + 1
            drafted, accepted = drafted + d, accepted + n - 1
            ctx[seq] += len(fed) - d + n - 1  # the fed token, plus the accepted drafts
            for j in range(n):
                out[seq].append(tokens[at + j])
                lps[seq].append(logprobs[at + j])
                k = top_counts[at + j] if top_counts else 0
                tops[seq].append(top_ids[alt : alt + k])
                alt += k
            at += n
            stop = next((j for j, t in enumerate(out[seq]) if t == EOS), None)
            if stop is not None or len(out[seq]) >= max_new:
                end = min(max_new, len(out[seq]) if stop is None else stop + 1)
                del out[seq][end:], lps[seq][end:], tops[seq][end:]
                finished.append(seq)
                free += owned.pop(seq)
                del ctx[seq]
    runner.execute(codec.decode(codec.encode(StepPlan(step=step + 1, finished=finished))))
    assert runner.seqs == {}
    return out, lps, tops, (drafted, accepted)


def answer_drafter(answers: dict[int, list[int]], k: int) -> DraftFn:
    """Drafts the next k tokens of the known answer, spoiling one of them every third step (so some drafts are
    rejected at every place)."""
    calls = {}

    def draft(seq: int, so_far: list[int]) -> list[int]:
        calls[seq] = calls.get(seq, 0) + 1
        drafts = list(answers[seq][len(so_far) : len(so_far) + k])
        if drafts and calls[seq] % 3 == 0:
            spoil = calls[seq] % len(drafts)
            drafts[spoil] = (drafts[spoil] + 7) % 900 + 3
        return drafts

    return draft


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_drafts_matches_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = prompts_for(model_dir)[1:4]
    max_new = 24
    want = {i: reference_generate(model_dir, p, max_new) for i, p in enumerate(prompts)}
    runner = ModelRunner(str(model_dir), num_blocks=64, block_size=4)  # drafts cross block bounds
    greedy = [SamplingParams() for _ in prompts]
    got, _, _, (drafted, accepted) = drive_drafted(runner, prompts, max_new, greedy, answer_drafter(want, 4))
    assert got == want
    assert 0 < accepted < drafted  # both paths ran


def test_constrained_rows_with_drafts_equal_their_undrafted_answers(tiny_dirs):
    """Grammar rows verify drafts too: each pick is masked by the grammar after the drafts before it, so greedy and
    seeded answers are the same with drafts (right and spoiled ones) as without, and every one is valid."""
    model_dir = tiny_dirs["qwen2"]
    prompts = prompts_for(model_dir)[1:5]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 12}}}
    grammars = {
        0: grammar_text({"type": "json", "value": schema})[1],
        1: grammar_text({"type": "regex", "value": r"[a-z]{3,9}( [a-z]{2,9}){2,6}\."})[1],
        2: grammar_text({"type": "json", "value": schema})[1],
    }  # row 3 unconstrained
    params = [SamplingParams(), SamplingParams(), SamplingParams(do_sample=True, seed=5), SamplingParams()]
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4)
    plain, plain_lps, _, _ = drive_drafted(runner, prompts, 40, params, None, grammars)
    before = runner.grammars.constraints.stats["draft_rows"]
    got, lps, _, (drafted, accepted) = drive_drafted(runner, prompts, 40, params, answer_drafter(plain, 4), grammars)
    assert got == plain
    np.testing.assert_allclose(np.concatenate(list(lps.values())), np.concatenate(list(plain_lps.values())), atol=1e-5)
    assert 0 < accepted < drafted
    assert runner.grammars.constraints.stats["draft_rows"] > before  # the grammar rows' picks were masked per draft
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for i in (0, 2):
        assert got[i][-1] == EOS
        jsonschema.validate(json.loads(tok.decode(got[i][:-1])), schema)
    assert re.fullmatch(r"[a-z]{3,9}( [a-z]{2,9}){2,6}\.", tok.decode(got[1][:-1]))


def test_seeded_sampling_is_the_same_with_and_without_drafts(tiny_dirs):
    model_dir = tiny_dirs["llama"]
    prompts = prompts_for(model_dir)[1:4]
    params = [
        SamplingParams(do_sample=True, temperature=0.8, seed=11, repetition_penalty=1.3, top_n_tokens=3),
        SamplingParams(do_sample=True, top_k=20, seed=12, frequency_penalty=0.5),
        SamplingParams(repetition_penalty=1.2, top_n_tokens=2),  # greedy, with a history
    ]
    runner = ModelRunner(str(model_dir), num_blocks=64, block_size=4)
    plain, plain_lps, plain_tops, _ = drive_drafted(runner, prompts, 20, params, None)
    got, lps, tops, (drafted, accepted) = drive_drafted(runner, prompts, 20, params, answer_drafter(plain, 3))
    assert got == plain and tops == plain_tops
    np.testing.assert_allclose(np.concatenate(list(lps.values())), np.concatenate(list(plain_lps.values())), atol=1e-5)
    assert 0 < accepted < drafted


def test_accept_keeps_the_matching_prefix_and_one_more():
    picks = np.array([5, 6, 7, 9, 1, 1, 3, 4, 4])  # rows: 3 drafts, 0 drafts, 3 drafts
    keep, counts = accept(picks, [np.array([5, 6, 8]), np.array([], int), np.array([2, 3, 9])])
    assert counts.tolist() == [3, 1, 1]  # 5, 6 match, 7 replaces 8; row 2: its first pick 1 ≠ 2
    assert keep.tolist() == [True, True, True, False, True, True, False, False, False]
    keep, counts = accept(np.array([4, 4, 4]), [np.array([4, 4])])
    assert counts.tolist() == [3] and keep.all()  # every draft accepted, plus the bonus pick
    choice = Choice(
        torch.tensor([1, 2, 3]),
        torch.tensor([-0.1, -0.2, -0.3]),
        torch.tensor([1, 2, 0]),
        torch.tensor([10, 20, 21]),
        torch.tensor([-1.0, -2.0, -2.1]),
    )
    kept = select(choice, np.array([False, True, True]))
    assert kept.token_ids.tolist() == [2, 3] and kept.top_counts.tolist() == [2, 0]
    assert kept.top_ids.tolist() == [20, 21]


def test_kept_positions_cover_every_pick_of_a_drafted_row():
    cu = np.array([0, 5, 8, 9])  # a prefill of 5, a drafted row of 3 (2 drafts), a decode
    keep, sample_at, prompt_at = kept_positions(cu, np.array([True, True, True]), [], np.array([0, 2, 0]))
    assert keep.tolist() == [4, 5, 6, 7, 8] and sample_at.tolist() == [0, 1, 2, 3, 4] and prompt_at == []
    keep, sample_at, prompt_at = kept_positions(cu, np.array([True, True, True]), [0], np.array([0, 2, 0]))
    assert keep.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8] and sample_at.tolist() == [4, 5, 6, 7, 8]


def test_a_plan_that_drafts_a_sampled_row_wrongly_is_refused(tiny_dirs):
    runner = ModelRunner(str(tiny_dirs["llama"]), num_blocks=4, block_size=4)
    plan = StepPlan(
        step=1,
        new=[NewSequence(1, SamplingParams())],
        blocks={1: [0, 1]},
        seqs=np.array([1], np.int32),
        num_tokens=np.array([3], np.int32),
        context_lens=np.array([0], np.int32),
        token_ids=np.array([5, 6, 7], np.int32),
        sample=np.array([0], np.uint8),
        drafts=np.array([2], np.int32),
    )
    with pytest.raises(ValueError, match="drafts"):
        runner.execute(plan)


# ---- the real Batcher drafting (prompt lookup) for the real ModelRunner ----------------------------------------


def speculating_batcher(num_blocks: int, speculate: int, prefill: int = 4096, **kw) -> Batcher:
    return Batcher(
        num_blocks, max_batch_size=16, max_batch_prefill_tokens=prefill, eos_ids={EOS}, block_size=4,
        speculate=speculate, **kw,
    )  # fmt: skip


class AnswerDrafter(Drafter):
    """Prompt lookup's place taken by the known answers (the tiny models never copy their input, so lookup's drafts
    are almost all rejected): drafts the answer's next tokens, one spoiled every third call."""

    def __init__(self, speculate: int, answers: dict[tuple, list[int]]) -> None:
        super().__init__(speculate)
        self.answers, self.calls = answers, 0

    def lookup(self, s, k):
        tokens = s.tokens(0, s.total).tolist()
        for prompt, answer in sorted(self.answers.items(), key=lambda kv: -len(kv[0])):
            done = tokens[len(prompt) :]
            if tokens[: len(prompt)] == list(prompt) and answer[: len(done)] == done:
                self.calls += 1
                drafts = answer[len(done) : len(done) + k]
                if drafts and self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 7) % 900 + 3
                return drafts, MAX_MATCH  # as sure as a long match
        raise AssertionError("a sequence that is no request's prompt and answer")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_drafting_with_prefix_hits_chunks_and_preemption_matches_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    p = prompts_for(model_dir)
    long = p[2]
    reqs = {
        "a": (long[:50], 16),
        "b": (long, 18),  # a prefix hit on a's blocks
        "copy": (p[1] + p[1] + p[1][:10], 24),  # the prompt repeats itself: lookup finds long matches
        "d": (p[1], 20),  # a prefix hit on copy's blocks
        "e": (p[4] + long[:20], 16),
    }
    want = {rid: reference_generate(model_dir, prompt, n) for rid, (prompt, n) in reqs.items()}
    for drafter in ("lookup", "answers"):
        arrivals = {0: [request("a", *reqs["a"]), request("copy", *reqs["copy"])]}
        arrivals[3] = [request("b", *reqs["b"]), request("d", *reqs["d"]), request("e", *reqs["e"])]
        runner = ModelRunner(str(model_dir), num_blocks=40, block_size=4)
        b = speculating_batcher(40, speculate=4, prefill=24)  # KV for far fewer tokens than wanted at once
        if drafter == "answers":
            b.drafter = AnswerDrafter(4, {tuple(prompt): want[rid] for rid, (prompt, _) in reqs.items()})
        got, _ = serve(runner, b, arrivals)
        assert got == want, f"{arch}, {drafter} drafts"
        c = b.counters
        assert c["draft_tokens"] > 0 and c["prefix_hit_tokens"] > 0 and c["preemptions"] > 0, c
        assert c["chunked_prefills"] > 0 and b.allocator.free == 40, c  # every block came back, trimmed ones too
        if drafter == "answers":
            assert c["draft_tokens"] > c["accepted_tokens"] > c["draft_tokens"] // 2, c


def test_seeded_sampling_with_drafting_equals_without(tiny_dirs):
    model_dir = tiny_dirs["llama"]
    p = prompts_for(model_dir)
    warm = dict(do_sample=True, temperature=0.7, repetition_penalty=1.2, top_n_tokens=2)

    def run(drafter: Drafter | None):
        runner = ModelRunner(str(model_dir), num_blocks=64, block_size=4)
        b = speculating_batcher(64, 0)
        b.drafter = drafter
        arrivals = {0: [request(f"r{i}", p[1][i:] + p[1][:20], 24, seed=i, **warm) for i in range(3)]}
        arrivals[2] = [request("g", p[2], 24)]
        return serve(runner, b, arrivals)[0], b

    want, _ = run(None)
    prompts = {f"r{i}": p[1][i:] + p[1][:20] for i in range(3)} | {"g": p[2]}
    got, b = run(AnswerDrafter(3, {tuple(prompts[rid]): out for rid, out in want.items()}))
    assert got == want and b.counters["accepted_tokens"] > 0
