"""The in-process engine (bench/engine.py): the real Batcher driving the real ModelRunner, no sockets. Prefix hits,
chunked prefill and preemption by recompute must leave greedy output equal to transformers' generate(), token for
token, for every tiny arch."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from bench.engine import Engine, request
from libs.protocol.messages import TokenizedRequest
from services.scheduler.batcher import Batcher
from services.shard.model_runner import ModelRunner
from tests.reference import reference_generate
from tests.tiny_models import ARCHS, EOS, prompts_for

BS = 4  # small pages: many full blocks to hit, KV that runs out quickly


def serve(runner: ModelRunner, batcher: Batcher, arrivals: dict[int, list[TokenizedRequest]]):
    """Run to completion through the engine; (tokens per request, prompt logprobs per request). The engine checks
    that no offset repeats or skips."""
    outputs = Engine(runner, batcher).run(arrivals, max_steps=2000)
    assert not batcher.has_work()
    return {rid: o.tokens for rid, o in outputs.items()}, {rid: o.prompt_logprobs for rid, o in outputs.items()}


def new_batcher(num_blocks: int, prefill: int = 4096, **kw) -> Batcher:
    return Batcher(num_blocks, max_batch_size=16, max_batch_prefill_tokens=prefill, eos_ids={EOS}, block_size=BS, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_chunks_and_preemption_match_generate(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    p = prompts_for(model_dir)
    long = p[2]  # 58 tokens: far past the sliding window
    reqs = {
        "a": (long[:50], 12),
        "b": (long, 14),  # shares a's first 48 tokens
        "c": (long[:50], 12),  # a again: everything but the last block from the cache
        "d": (p[1], 16),
        "e": (p[4] + long[:20], 12),
        "f": (p[1][:30], 10),
    }
    arrivals = {0: [request("a", *reqs["a"])], 3: [request("b", *reqs["b"]), request("d", *reqs["d"])]}
    arrivals[6] = [request("c", *reqs["c"]), request("e", *reqs["e"]), request("f", *reqs["f"])]
    runner = ModelRunner(str(model_dir), num_blocks=28, block_size=BS)
    b = new_batcher(28, prefill=24)  # 112 tokens of KV for ~400 wanted at once; 24-token prefill steps
    got, _ = serve(runner, b, arrivals)
    for rid, (prompt, max_new) in reqs.items():
        assert got[rid] == reference_generate(model_dir, prompt, max_new), f"{arch} request {rid}"
    c = b.counters
    assert c["prefix_hit_tokens"] >= 48 and c["preemptions"] > 0 and c["chunked_prefills"] > 0, c
    assert b.allocator.free == 28


def test_penalty_history_includes_the_cached_prefix(tiny_dirs):
    """A prefix hit starts the shard's sequence past the prompt's start: the penalties still see the whole prompt
    (the shard's history holds every token up to each fed position), and the output equals an uncached run."""
    model_dir = tiny_dirs["llama"]
    prompt = prompts_for(model_dir)[2]
    penal = dict(repetition_penalty=3.0, frequency_penalty=2.0)

    def run(caching: bool, drop_prefix: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        runner = ModelRunner(str(model_dir), num_blocks=64, block_size=BS)
        seen = []  # (history length, context + fed) of every fed row that keeps a history
        execute = runner.execute

        def checked(plan):
            if drop_prefix:  # a scheduler that forgot to send the prefix ids
                plan.new = [msgspec.structs.replace(new, prefix_ids=[]) for new in plan.new]
            result = execute(plan)
            for seq, ctx, n in zip(plan.seqs.tolist(), plan.context_lens.tolist(), plan.num_tokens.tolist()):
                st = runner.seqs.get(seq)
                if st is not None and st.history is not None:
                    seen.append((len(st.history.view()), ctx + n))
            return result

        runner.execute = checked
        b = new_batcher(64, prefix_caching=caching)
        got, _ = serve(runner, b, {0: [request("warm", prompt, 2)], 3: [request("x", prompt, 12, **penal)]})
        assert (b.counters["prefix_hit_tokens"] > 0) == caching and seen
        return got["x"], seen

    want, _ = run(caching=False)
    got, seen = run(caching=True)
    assert got == want and all(h == n for h, n in seen)
    _, seen = run(caching=True, drop_prefix=True)  # the check sees a history that lacks the prefix
    assert any(h != n for h, n in seen)


def test_prompt_logprobs_skip_the_cache_and_survive_preemption(tiny_dirs):
    model_dir = tiny_dirs["qwen2"]
    prompt = prompts_for(model_dir)[2]

    def run(num_blocks: int, others: int) -> tuple[dict, Batcher]:
        runner = ModelRunner(str(model_dir), num_blocks=num_blocks, block_size=BS)
        b = new_batcher(num_blocks, prefill=32)
        first = [request("warm", prompt, 2)]
        later = [request("x", prompt, 20, prompt_logprobs=True)]
        later += [request(f"o{i}", prompt[i:], 20) for i in range(others)]  # pressure: x gets preempted
        return serve(runner, b, {0: first, 4: later}), b

    (want, want_lps), _ = run(256, 0)
    (got, got_lps), b = run(40, 3)
    assert b.counters["preemptions"] > 0
    assert got["x"] == want["x"] == reference_generate(model_dir, prompt, 20)
    assert len(got_lps["x"]) == len(prompt) and math.isnan(got_lps["x"][0])
    np.testing.assert_allclose(got_lps["x"][1:], want_lps["x"][1:], rtol=1e-4, atol=1e-4)


def test_seeded_sampling_survives_preemption(tiny_dirs):
    """A sampled request that is preempted and recomputed draws the same tokens as one that never was: each draw is
    seeded by the request's seed and the token's position, not by how many draws its generator made before."""
    model_dir = tiny_dirs["llama"]
    prompt = prompts_for(model_dir)[2]
    hot = dict(do_sample=True, temperature=2.0, top_k=50)

    def run(num_blocks: int, others: int) -> tuple[dict, Batcher]:
        runner = ModelRunner(str(model_dir), num_blocks=num_blocks, block_size=BS)
        b = new_batcher(num_blocks, prefill=32)
        # x comes last: the newest running request is the one preempted when KV runs out
        later = [request(f"o{i}", prompt[i:], 20, seed=i, **hot) for i in range(others)]
        later += [request("x", prompt, 20, seed=11, **hot)]
        got, _ = serve(runner, b, {0: [request("warm", prompt, 2)], 4: later})
        return got, b

    want, _ = run(256, 0)
    got, b = run(36, 3)  # x is preempted after 12 tokens (and o1 after 14)
    assert b.counters["preemptions"] > 0
    assert got["x"] == want["x"] and len(set(got["x"])) > 5  # really sampled: many distinct tokens
