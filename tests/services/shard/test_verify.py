"""The shard's verification of drafted tokens (services/shard/verify.py) on the tiny models.

The engine (bench/engine.py) feeds decode rows as [last token, d1..dk] with drafts that are partly right and partly
wrong (taken from the answer itself, then spoiled), so both the accept and the reject paths run: greedy output must
still equal transformers' generate() token for token, and a seeded sampled request (with a repetition penalty, whose
history must drop rejected drafts) must yield the same tokens, logprobs and alternatives as without drafts.
"""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from bench.engine import Engine, request
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan
from services.scheduler.batcher import Batcher
from services.scheduler.drafting import MAX_MATCH, Drafter
from services.shard.model_runner import ModelRunner
from services.shard.sampling.sampler import Choice
from services.shard.verify import accept, kept_positions, select
from services.tokenizer.grammar import grammar_text
from tests.bench.test_engine import serve
from tests.reference import reference_generate
from tests.tiny_models import EOS, prompts_for


def drafted_run(runner: ModelRunner, prompts, max_new, params, answers=None, grammars=None, k: int = 4):
    """Every prompt arrives at once (with its grammar, if `grammars` gives one); with `answers`, decode rows carry
    drafts of the known answers, one spoiled every third call. Per prompt: its tokens, logprobs and alternatives'
    ids, and the (drafted, accepted) totals."""
    b = speculating_batcher(runner.num_blocks, speculate=k if answers else 0)
    if answers:
        b.drafter = AnswerDrafter(k, {tuple(prompts[i]): answers[i] for i in answers}, always=True)
    reqs = [
        request(str(i), p, max_new, grammar=(grammars or {}).get(i, ""), **msgspec.structs.asdict(params[i]))
        for i, p in enumerate(prompts)
    ]
    out = Engine(runner, b).run({0: reqs})
    tokens = {i: out[str(i)].tokens for i in range(len(prompts))}
    lps = {i: out[str(i)].logprobs for i in range(len(prompts))}
    tops = {i: [ids for ids, _ in out[str(i)].top] for i in range(len(prompts))}
    return tokens, lps, tops, (b.counters["draft_tokens"], b.counters["accepted_tokens"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_drafts_matches_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    prompts = prompts_for(model_dir)[1:4]
    max_new = 24
    want = {i: reference_generate(model_dir, p, max_new) for i, p in enumerate(prompts)}
    runner = ModelRunner(str(model_dir), num_blocks=64, block_size=4)  # drafts cross block bounds
    greedy = [SamplingParams() for _ in prompts]
    got, _, _, (drafted, accepted) = drafted_run(runner, prompts, max_new, greedy, want)
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
    plain, plain_lps, _, _ = drafted_run(runner, prompts, 40, params, None, grammars)
    before = runner.grammars.constraints.stats["draft_rows"]
    got, lps, _, (drafted, accepted) = drafted_run(runner, prompts, 40, params, plain, grammars)
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
    plain, plain_lps, plain_tops, _ = drafted_run(runner, prompts, 20, params)
    got, lps, tops, (drafted, accepted) = drafted_run(runner, prompts, 20, params, plain, k=3)
    assert got == plain and tops == plain_tops
    # a verify step's products have more rows than a decode's, and on some CPUs sum in another order: logits a few
    # float32 ulps apart, logprobs within ~2e-5
    np.testing.assert_allclose(np.concatenate(list(lps.values())), np.concatenate(list(plain_lps.values())), atol=5e-5)
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

    def __init__(self, speculate: int, answers: dict[tuple, list[int]], always: bool = False) -> None:
        super().__init__(speculate, always)
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
