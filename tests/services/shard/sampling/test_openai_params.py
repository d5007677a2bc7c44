"""min_p, logit_bias and min_tokens on synthetic float32 logits, against transformers' own MinPLogitsWarper,
SequenceBiasLogitsProcessor and MinNewTokensLengthLogitsProcessor (eager, same run)."""

from __future__ import annotations

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from libs.protocol.params import SamplingParams
from services.shard.sampling.sampler import choose, final_scores

VOCAB = 64
EOS = [3, 7]


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def _hf_chain(p: SamplingParams) -> LogitsProcessorList:
    chain = LogitsProcessorList()
    if p.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        chain.append(MinPLogitsWarper(p.min_p))
    if p.typical_p < 1.0:
        chain.append(TypicalLogitsWarper(p.typical_p))
    return chain


def test_min_p_matches_transformers_in_its_place_among_the_warpers():
    params = [
        SamplingParams(do_sample=True, min_p=0.1),
        SamplingParams(do_sample=True, min_p=0.05, temperature=0.7, top_k=20),
        SamplingParams(do_sample=True, min_p=0.3, top_p=0.9, typical_p=0.95),
        SamplingParams(do_sample=True),  # neutral row in the same batch
        SamplingParams(do_sample=True, min_p=1.0),  # only the best survives
    ]
    logits = _logits(len(params))
    scores, _ = final_scores(logits, params)
    for i, p in enumerate(params):
        want = _hf_chain(p)(None, logits[i : i + 1].clone())[0]
        assert torch.equal(torch.isinf(scores[i]), torch.isinf(want)), i
        finite = ~torch.isinf(want)
        torch.testing.assert_close(scores[i][finite], want[finite], rtol=0, atol=0)
    assert int((~torch.isinf(scores[4])).sum()) == 1


def test_logit_bias_matches_sequence_bias_processor_for_single_tokens():
    bias = {5: 2.5, 11: -7.0, 40: 100.0, 63: -100.0}
    params = [SamplingParams(logit_bias=bias), SamplingParams()]
    logits = _logits(2, seed=1)
    scores, _ = final_scores(logits, params)
    hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
    want = hf(torch.zeros(1, 3, dtype=torch.long), logits[:1].clone())[0]
    torch.testing.assert_close(scores[0], want, rtol=0, atol=0)
    assert torch.equal(scores[1], logits[1])


def test_logit_bias_plus_100_forces_and_minus_100_bans():
    logits = _logits(1, seed=2)
    greedy = int(logits[0].argmax())
    forced = (greedy + 9) % VOCAB
    assert int(choose(logits, [SamplingParams(logit_bias={forced: 100.0})], [None]).token_ids[0]) == forced
    banned = choose(logits, [SamplingParams(logit_bias={greedy: -100.0})], [None]).token_ids[0]
    assert int(banned) == int(logits[0].topk(2).indices[1])
    # sampled too: no draw ever takes the banned token, every draw takes the forced one
    p = SamplingParams(do_sample=True, seed=1, logit_bias={greedy: -100.0})
    gen = torch.Generator().manual_seed(0)
    assert all(int(choose(logits, [p], [gen]).token_ids[0]) != greedy for _ in range(200))
    p = SamplingParams(do_sample=True, seed=1, logit_bias={forced: 100.0})
    assert all(int(choose(logits, [p], [gen]).token_ids[0]) == forced for _ in range(50))


def test_min_tokens_matches_min_new_tokens_length_processor():
    prompt, k = 5, 3
    p = SamplingParams(min_length=prompt + k, min_length_ids=EOS)
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=prompt, min_new_tokens=k, eos_token_id=EOS)
    logits = _logits(1, seed=3)
    for generated in range(6):
        length = prompt + generated
        scores, _ = final_scores(logits, [p], lengths=[length])
        want = hf(torch.zeros(1, length, dtype=torch.long), logits.clone())[0]
        assert torch.equal(scores[0], want), generated
        assert torch.isinf(scores[0, EOS]).all() == (generated < k)


def test_min_tokens_keeps_eos_from_winning_while_short():
    logits = _logits(2, seed=4)
    logits[:, 7] = 50.0  # EOS is the greedy pick
    p = SamplingParams(min_length=10, min_length_ids=EOS)
    picks = choose(logits, [p, p], [None, None], lengths=[9, 10]).token_ids.tolist()
    assert picks[0] != 7 and picks[1] == 7


def test_biases_with_penalties_and_warpers_in_one_batch():
    """logit_bias, then the penalties on the biased scores (vLLM's order), then the warpers."""
    history = np.array([1, 2, 5], dtype=np.int64)
    p = SamplingParams(do_sample=True, logit_bias={5: 3.0}, repetition_penalty=1.3, min_p=0.05)
    logits = _logits(1, seed=5)
    scores, _ = final_scores(logits, [p], [history])
    want = logits[0].clone()
    want[5] += 3.0
    seen = want[[1, 2, 5]]
    want[[1, 2, 5]] = torch.where(seen < 0, seen * 1.3, seen / 1.3)
    want = MinPLogitsWarper(0.05)(None, want[None])[0]
    torch.testing.assert_close(scores[0], want, rtol=0, atol=0)
