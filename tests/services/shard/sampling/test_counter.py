"""The counter-keyed draws (services/shard/sampling/counter.py): reproducible by (seed, position) whatever the batch,
exact draws from softmax(scores) (checked on fixed seeds, so nothing here can flake), masked tokens never drawn,
and the hash's uniforms strictly inside (0,1) and uniform; then choose(keys=...) and the runner's device_sampling."""

from __future__ import annotations

import math

import pytest
import torch

from bench.engine import Engine, request
from libs.protocol.params import SamplingParams
from services.shard.model_runner import ModelRunner
from services.shard.sampling import counter
from services.shard.sampling.counter import DrawKeys, draw, hash_bits, to_uniform, uniforms
from services.shard.sampling.sampler import choose
from tests.tiny_models import prompts_for

CPU = torch.device("cpu")
LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -2.0, float("-inf"), 0.3]


def _keys(seeds, positions) -> DrawKeys:
    return DrawKeys.of(list(seeds), list(positions), CPU)


def _chi2_tv(tokens: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square over the finite tokens and the total-variation distance, against softmax(logits)."""
    p = torch.softmax(logits.double(), dim=-1)
    counts = torch.bincount(tokens, minlength=len(p)).double()
    n = counts.sum()
    live = p > 0
    assert counts[~live].sum() == 0
    chi2 = float((((counts - n * p) ** 2)[live] / (n * p[live])).sum())
    return chi2, float((counts / n - p).abs().sum() / 2)


def test_mul32_and_key_bits_are_exact():
    x = torch.tensor([0, 1, 2**16 - 1, 2**16, 2**31, 2**32 - 1, 123456789, 3141592653], dtype=torch.int64)
    for c in (0x85EBCA6B, 0xC2B2AE35, 0xFFFFFFFF, 1):
        want = [(int(v) * c) & 0xFFFFFFFF for v in x]
        assert counter._mul32(x, c).tolist() == want
    # a seed's 64 bits, whatever Python int names them: 2**64 - 1 and -1 are the same seed
    a, b = _keys([2**64 - 1, 2**63], [0, 0]), _keys([-1, -(2**63)], [0, 0])
    assert torch.equal(a.seeds, b.seeds) and torch.equal(hash_bits(a, 16), hash_bits(b, 16))
    bits = hash_bits(_keys(range(64), range(64)), 4096)
    assert bits.min() >= 0 and bits.max() < 2**32
    assert all(len(set(row.tolist())) == 4096 for row in bits[:4])  # a bijection of token ids per row


def test_same_key_same_token_whatever_the_batch():
    torch.manual_seed(0)
    scores = torch.randn(12, 300) * 3
    scores[11] = scores[10]  # rows 10 and 11: the same request at the same position (seed 3, position 4)
    seeds, positions = [7, 7, 8, 9, 2**64 - 5, 0, 1, 7, 42, 42, 3, 3], [0, 1, 0, 5, 9, 0, 0, 2, 100, 101, 4, 4]
    whole = draw(scores, _keys(seeds, positions))
    alone = torch.cat([draw(scores[i : i + 1], _keys(seeds[i : i + 1], positions[i : i + 1])) for i in range(12)])
    assert torch.equal(whole, alone)
    order = torch.randperm(12)
    shuffled = draw(scores[order], _keys([seeds[i] for i in order], [positions[i] for i in order]))
    assert torch.equal(shuffled, whole[order])
    # beside other rows, in a chunked call: the same again
    more = torch.cat([torch.randn(40, 300), scores])
    counter_chunk = counter.CHUNK_ELEMENTS
    try:
        counter.CHUNK_ELEMENTS = 300 * 3
        beside = draw(more, _keys(list(range(40)) + seeds, [0] * 40 + positions))
    finally:
        counter.CHUNK_ELEMENTS = counter_chunk
    assert torch.equal(beside[40:], whole)
    assert whole[10] == whole[11]


def test_other_seeds_and_positions_draw_other_tokens():
    flat = torch.zeros(200, 1000)
    by_seed = draw(flat, _keys(range(200), [3] * 200))
    by_position = draw(flat, _keys([5] * 200, range(200)))
    # 200 draws from 1000 equally likely tokens: ~181 distinct expected; a hash ignoring its key gives 1
    assert len(set(by_seed.tolist())) > 150 and len(set(by_position.tolist())) > 150
    assert (by_seed != by_position).sum() > 150


@pytest.mark.parametrize("vary", ["seed", "position"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_the_softmax(vary, dtype):
    """20 000 draws over fixed keys: chi-square (6 degrees of freedom: P(> 40) ≈ 5e-7 for a true sampler) and
    total variation within bounds a correct sampler meets, which the softmax at twice the temperature, or a
    shifted one, fails by far."""
    n = 20_000
    logits = torch.tensor(LOGITS).to(dtype)
    seeds, positions = (range(n), [17] * n) if vary == "seed" else ([2**63 + 11] * n, range(n))
    tokens = draw(logits.expand(n, -1), _keys(seeds, positions))
    assert not (tokens == LOGITS.index(float("-inf"))).any()
    chi2, tv = _chi2_tv(tokens, logits.float())
    assert chi2 < 40 and tv < 0.02, (chi2, tv)
    hotter, hotter_tv = _chi2_tv(tokens, logits.float() / 2)
    assert hotter > 1000 and hotter_tv > 0.1
    colder, _ = _chi2_tv(tokens, logits.float() * 1.1)
    assert colder > 40


def test_bf16_scores_draw_as_their_float32_values():
    torch.manual_seed(1)
    scores = (torch.randn(64, 500) * 4).bfloat16()
    keys = _keys(range(64), range(64))
    assert torch.equal(draw(scores, keys), draw(scores.float(), keys))


def test_masked_tokens_are_never_drawn():
    torch.manual_seed(2)
    n, vocab = 2000, 256
    scores = torch.randn(n, vocab) * 5
    allowed = torch.rand(n, vocab) < 0.05
    allowed[:, 0] = True
    scores[~allowed] = float("-inf")
    scores[:100, 0] = -1e4  # a very unlikely token that is still allowed: alone, it is always drawn
    scores[:100, 1:] = float("-inf")
    tokens = draw(scores, _keys(range(n), [0] * n))
    assert allowed[torch.arange(n), tokens].all()
    assert (tokens[:100] == 0).all()


def test_uniforms_are_strictly_inside_and_uniform():
    ends = torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    u = to_uniform(ends)
    assert (u > 0).all() and (u < 1).all() and u[0] == 2.0**-33
    u = uniforms(_keys(range(1000), range(1000)), 1000)  # a million
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    counts = torch.bincount((u * 100).long().flatten(), minlength=100).double()
    chi2 = float(((counts - 1e4) ** 2 / 1e4).sum())
    assert chi2 < 200, chi2  # 99 degrees of freedom: mean 99, P(> 200) < 1e-8
    assert abs(float(u.mean()) - 0.5) < 2e-3
    # neighbouring tokens, positions and seeds are uncorrelated (|r| of a million pairs ~ 1e-3)
    x = u - 0.5
    for a, b in ((x[:, :-1], x[:, 1:]), (x[:-1], x[1:])):
        r = float((a * b).mean() / (a.std() * b.std()))
        assert abs(r) < 5e-3, r
    low = hash_bits(_keys(range(200), [0] * 200), 5000) & 0xFF  # the low bits too
    counts = torch.bincount(low.flatten(), minlength=256).double()
    expect = low.numel() / 256
    assert float(((counts - expect) ** 2 / expect).sum()) < 400  # 255 degrees of freedom


def test_choose_with_keys_draws_sampled_rows_by_the_counter():
    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 2
    params = [
        SamplingParams(do_sample=True, seed=1),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=10, seed=2),
        SamplingParams(do_sample=True, seed=3, top_n_tokens=3),
    ]
    keys = _keys([1, 0, 2, 3], [5, 5, 6, 7])
    got = choose(logits, params, [None] * 4, keys=keys)
    assert got.token_ids[1] == logits[1].argmax()  # greedy rows as ever
    assert got.token_ids[0] == draw(logits[:1], keys.select([0]))[0]
    warped = logits[2:3] / 0.7
    warped[warped < warped.topk(10).values[:, -1:]] = float("-inf")
    assert got.token_ids[2] == draw(warped, keys.select([2]))[0]
    want = torch.log_softmax(logits, dim=-1).gather(1, got.token_ids[:, None])[:, 0]
    assert torch.allclose(got.logprobs[[0, 1, 3]], want[[0, 1, 3]], atol=1e-5)
    assert got.top_counts.tolist() == [0, 0, 0, 3]
    # without keys, the generators draw (today's CPU path)
    gens = [torch.Generator().manual_seed(9) for _ in range(4)]
    plain = choose(logits, params, gens)
    assert plain.token_ids[1] == got.token_ids[1]


def test_runner_device_sampling_is_per_request(tiny_dirs):
    """With device_sampling a seeded request draws the same tokens alone or batched with others, another seed
    other tokens; the default on CPU stays the generators'."""
    model_dir = tiny_dirs["llama"]
    prompt = prompts_for(model_dir)[1]
    hot = dict(do_sample=True, temperature=3.0)
    arrivals = {
        0: [request("a", prompt, 8, **hot, seed=42), request("other", prompt, 8, **hot, seed=7)],
        1: [request("b", prompt, 8, **hot, seed=42)],
    }
    runner = ModelRunner(str(model_dir), num_blocks=32, block_size=8, device_sampling=True)
    got = Engine.build(runner, model_dir).run(arrivals)
    assert got["a"].tokens == got["b"].tokens != got["other"].tokens
    assert not ModelRunner(str(model_dir), num_blocks=4, block_size=8).device_sampling


def test_chi2_bound_is_generous():
    """The chi-square bound used above (40 at 6 degrees of freedom) sits far in the tail: P(chi2_6 > 40)."""
    tail = math.exp(-20) * sum(20**k / math.factorial(k) for k in range(3))  # survival of chi2 with 6 dof at 40
    assert tail < 1e-6
