"""The token choice's fast paths give what the plain path gives: all-greedy batches without the full
log-softmax, the blockwise argmax, bf16 logits without a float32 copy, grammar-masked rows, mixed batches against
the plain step, seeded rows drawn by inversion in one batch as each row alone draws, from the softmax's law."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.protocol.params import SamplingParams


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 300_000), (9, 1 << 17), (3, 50)])
def test_greedy_fast_path_equals_argmax_and_log_softmax(rows, vocab, monkeypatch):
    """All-greedy batches skip the full log-softmax: same tokens, and logprobs computed in chunks of rows (a small
    chunk size makes the 9-row case cross chunk boundaries)."""
    from services.shard.sampling import reduction, sampler

    monkeypatch.setattr(reduction, "GREEDY_CHUNK_ELEMENTS", 1 << 18)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 4
    logits[0, 3:5] = logits[0].max() + 1  # a tie: the first index wins, as with argmax
    c = sampler.choose(logits, [SamplingParams()] * rows, [None] * rows)
    ids, logprobs = c.token_ids, c.logprobs
    assert ids.tolist() == torch.argmax(logits, -1).tolist() and ids[0] == 3
    # against float64: closer than float32's own log-softmax, which is off by ~7e-5 at 300k tokens
    want = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [100, 128, 1000, 128_256])
def test_greedy_argmax_by_blocks_equals_torchs(dtype, vocab):
    """The blockwise argmax picks torch.argmax's index everywhere: the maximum in the short last block, ties across
    blocks, NaN (the first one wins, as in torch) and all -inf rows; bf16 logits give float32's answer."""
    from services.shard.sampling import reduction, sampler

    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    logits[0, -1] = 99.0  # in the last (short) block
    logits[1, [1, vocab - 2]] = 99.0  # a tie across blocks
    logits[2, [vocab // 2, 3]] = float("nan")
    logits[3] = float("-inf")
    logits[4, 0] = 99.0
    assert torch.equal(reduction.block_argmax(logits.float())[0], torch.argmax(logits.float(), -1))
    c = sampler.choose(logits, [SamplingParams()] * 6, [None] * 6)
    ids, logprobs = c.token_ids, c.logprobs
    assert ids.tolist() == torch.argmax(logits.float(), -1).tolist()
    assert ids[0] == vocab - 1 and ids[1] == 1 and ids[2] == 3 and ids[4] == 0
    want = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None])[:, 0]
    keep = [0, 1, 4, 5]  # rows 2 and 3 have no finite logprob
    torch.testing.assert_close(logprobs[keep].double(), want[keep], rtol=1e-6, atol=1e-6)


def _transformers_logits(vocab: int, dtype: torch.dtype, rows: int = 8) -> torch.Tensor:
    """The last position's logits of a small random-weight Llama with `vocab` ids, one prompt per row, eager."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(vocab)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, vocab, (rows, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 49_153, 128_256])
def test_greedy_on_transformers_logits(vocab, dtype):
    """A model's own logits, as the shard gets them (bf16 not converted first): the token is transformers' argmax,
    the logprob its float64 log-softmax within float32 rounding of the logsumexp."""
    from services.shard.sampling import sampler

    logits = _transformers_logits(vocab, dtype)
    assert logits.dtype == dtype
    c = sampler.choose(logits, [SamplingParams()] * len(logits), [None] * len(logits))
    assert c.token_ids.tolist() == torch.argmax(logits, -1).tolist()
    want = torch.log_softmax(logits.double(), -1).gather(-1, c.token_ids[:, None])[:, 0]
    assert c.logprobs.dtype == torch.float32
    torch.testing.assert_close(c.logprobs.double(), want, rtol=0, atol=1e-6)


def _old_choose_tokens(logits, params, seeds):
    """Tokens as `choose` picks them, without the chunked reduction: argmax of the final float32 scores, a seeded
    inversion draw (numpy, one row alone) from the softmax of a sampled row's."""
    from services.shard.sampling.sampler import final_scores

    scores = final_scores(logits, params)[0].float()
    ids = torch.argmax(scores, dim=-1)
    for i, p in enumerate(params):
        if p.samples():
            ids[i] = _inverted(scores[i], torch.Generator().manual_seed(seeds[i]))
    return ids, torch.log_softmax(scores.double(), dim=-1)


def _inverted(row: torch.Tensor, gen: torch.Generator | None) -> int:
    """One row drawn alone, in numpy: the first token whose running probability sum exceeds u · the sum."""
    cdf = np.cumsum(torch.softmax(row.float(), -1).numpy().astype(np.float64))
    u = float(torch.rand(1, generator=gen, dtype=torch.float64)[0])
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_picks_what_a_plain_step_picked(dtype):
    """Greedy, seeded and warped rows side by side (the speculative verifier relies on these very picks): the same
    tokens as the whole-batch argmax and each sampled row drawn alone; logprobs and alternatives from the final
    scores."""
    from services.shard.sampling import sampler

    vocab, rows = 30_011, 12
    params = [
        SamplingParams(top_n_tokens=3)
        if i % 4 == 1
        else SamplingParams(do_sample=True, seed=i, top_n_tokens=2 * (i % 3))
        if i % 4 == 2
        else SamplingParams(temperature=0.7, top_k=50, seed=i)
        if i % 4 == 3
        else SamplingParams()
        for i in range(rows)
    ]
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9)) * 1.5).to(dtype)
    seeds = [100 + i for i in range(rows)]
    c = sampler.choose(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
    want_ids, final = _old_choose_tokens(logits, params, seeds)
    assert c.token_ids.tolist() == want_ids.tolist()
    assert any(c.token_ids[i] != logits[i].float().argmax() for i in range(rows) if params[i].samples())
    torch.testing.assert_close(c.logprobs.double(), final.gather(-1, c.token_ids[:, None])[:, 0], rtol=0, atol=1e-6)
    assert c.top_counts.tolist() == [p.top_n_tokens for p in params]
    bounds = np.cumsum([0, *c.top_counts.tolist()])
    for i in range(rows):
        ids = c.top_ids[bounds[i] : bounds[i + 1]]
        torch.testing.assert_close(c.top_logprobs[bounds[i] : bounds[i + 1]].double(), final[i, ids], rtol=0, atol=1e-6)


def test_masked_rows_give_finite_logprobs_among_the_allowed():
    """Grammar masks leave a few finite scores in a row of -inf (here as logits and through `constrain`): the
    choice is among them, its logprob finite and that of the renormalised row; a single allowed token is certain."""
    from services.shard.sampling import sampler

    vocab = 262_143
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 3
    allowed = [torch.tensor([5, 77, vocab - 1]), torch.tensor([vocab - 1]), torch.arange(1000, 1300), None]

    def constrain(scores: torch.Tensor) -> None:
        for row, keep in enumerate(allowed):
            if keep is not None:
                masked = torch.full_like(scores[row], float("-inf"))
                masked[keep] = scores[row, keep]
                scores[row] = masked

    masked = logits.clone()
    constrain(masked)
    for dtype in (torch.float32, torch.bfloat16):
        for logits_in, kwargs in ((masked.to(dtype), {}), (logits.to(dtype), {"constrain": constrain})):
            c = sampler.choose(logits_in, [SamplingParams()] * 4, [None] * 4, **kwargs)
            want = torch.log_softmax(masked.to(dtype).double(), -1)
            assert c.token_ids.tolist() == want.argmax(-1).tolist()
            assert c.token_ids[1] == vocab - 1 and c.logprobs[1] == 0.0
            assert torch.isfinite(c.logprobs).all()
            torch.testing.assert_close(c.logprobs.double(), want.max(-1).values, rtol=0, atol=1e-6)


def test_no_full_float32_copy_or_log_softmax_of_bf16_logits(monkeypatch):
    """What the chunked reduction saves, checked where it happens: for bf16 logits and rows that change nothing
    (greedy, seeded draws, alternatives) no [rows, vocab] float32 copy is made and no log-softmax runs; the float32
    buffer holds one chunk of rows."""
    from services.shard.sampling import reduction, sampler

    rows, vocab = 16, 128_256
    made: list[tuple[int, ...]] = []
    real_float, real_to, real_empty = torch.Tensor.float, torch.Tensor.to, torch.empty
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: made.append(tuple(self.shape)) or real_float(self))

    def to(self, *a, **k):
        if torch.float32 in a or k.get("dtype") == torch.float32:
            made.append(tuple(self.shape))
        return real_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: pytest.fail("log_softmax over the batch"))
    buffers: list[tuple[int, ...]] = []

    def empty(*size, **kwargs):
        t = real_empty(*size, **kwargs)
        if t.dtype == torch.float32 and t.dim() == 2:
            buffers.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).bfloat16()
    params = [SamplingParams(), SamplingParams(top_n_tokens=4), SamplingParams(do_sample=True, seed=1)] * 5
    params.append(SamplingParams())
    c = sampler.choose(logits, params, [torch.Generator().manual_seed(1) for _ in params])
    assert len(c.token_ids) == rows
    assert (rows, vocab) not in made and (1, vocab) not in made
    assert [m for m in made if vocab in m] == [(5, vocab)]  # the sampled rows' softmax, those rows alone
    assert buffers == [(reduction.GREEDY_CHUNK_ELEMENTS // vocab, vocab)]
    monkeypatch.undo()
    want_ids, final = _old_choose_tokens(logits, params, [1] * rows)
    assert c.token_ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(c.logprobs.double(), final.gather(-1, c.token_ids[:, None])[:, 0], rtol=0, atol=1e-6)
    top = final[1].topk(4)
    assert c.top_counts.tolist() == [4 if i % 3 == 1 else 0 for i in range(rows)]
    assert c.top_ids[:4].tolist() == top.indices.tolist()
    torch.testing.assert_close(c.top_logprobs[:4].double(), top.values, rtol=0, atol=1e-6)


def test_seeded_rows_drawn_together_draw_what_each_row_draws_alone():
    """The batch's draws equal each row drawn alone with its generator; rows sharing a generator take its numbers in
    row order; a greedy row between them takes none."""
    from services.shard.sampling import sampler

    rows, vocab = 9, 50_000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)).bfloat16()
    params = [
        SamplingParams(do_sample=True, temperature=0.9, seed=i) if i != 4 else SamplingParams() for i in range(rows)
    ]
    c = sampler.choose(logits, params, [torch.Generator().manual_seed(10 + i) for i in range(rows)])
    want, _ = _old_choose_tokens(logits, params, [10 + i for i in range(rows)])
    assert c.token_ids.tolist() == want.tolist()
    assert len(set(c.token_ids.tolist())) > 2  # really drawn

    shared = torch.Generator().manual_seed(7)
    c = sampler.choose(logits, params, [shared] * rows)
    shared.manual_seed(7)
    scores = sampler.final_scores(logits, params)[0].float()
    serial = [_inverted(scores[i], shared) for i in range(rows) if i != 4]
    assert [t for i, t in enumerate(c.token_ids.tolist()) if i != 4] == serial


def test_draws_follow_the_softmax_and_never_take_a_masked_token(monkeypatch):
    """20,000 draws of one row: each token's share within 0.015 of its softmax probability, and the tokens at −inf
    (top-k's and a grammar's masked ones) never drawn, at the ends of the vocabulary too; the uniform numbers' ends
    (0, and 1 − 2⁻⁵³ whose product with the sum may round up to it) land on tokens of positive probability."""
    from services.shard.sampling.draws import draws

    row = torch.tensor([float("-inf"), 0.0, 1.0, float("-inf"), 2.0, -1.0, float("-inf")])
    probs = torch.softmax(row, -1)
    n = 20_000
    gens = [torch.Generator().manual_seed(1)] * n
    got = draws(row.expand(n, -1), list(range(n)), gens)
    share = torch.bincount(got, minlength=7).double() / n
    assert share[[0, 3, 6]].tolist() == [0.0, 0.0, 0.0]
    assert (share - probs.double()).abs().max() < 0.015

    for u in (0.0, 1.0 - 2.0**-53):  # the generator's number fixed: torch.rand as the draw calls it
        monkeypatch.setattr(torch, "rand", lambda *a, _u=u, **k: torch.full((1,), _u, dtype=torch.float64))
        token = int(draws(row[None], [0], [None])[0])
        assert probs[token] > 0, (u, token)
