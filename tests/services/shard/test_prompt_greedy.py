"""chunk_greedy: the raw argmax before each fed prompt token and its logprob, the same over chunks as at once."""

from __future__ import annotations

import math

import torch

from services.shard.prompt_logprobs import chunk_greedy, chunk_logprobs


def test_greedy_over_chunks_equals_one_pass():
    torch.manual_seed(0)
    logits, tokens = torch.randn(9, 50), torch.randint(0, 50, (9,))
    ids, lps = chunk_greedy(logits, None)
    want = torch.log_softmax(logits, -1)
    assert ids[0].item() == -1 and math.isnan(lps[0].item())
    assert ids[1:].tolist() == want[:-1].argmax(-1).tolist()
    torch.testing.assert_close(lps[1:], want[:-1].max(-1).values)
    # two chunks: the carried row gives the second chunk's first position
    _, carried = chunk_logprobs(logits[:4], tokens[:4], None)
    a_ids, a_lps = chunk_greedy(logits[:4], None)
    b_ids, b_lps = chunk_greedy(logits[4:], carried)
    assert torch.cat((a_ids, b_ids)).tolist() == ids.tolist()
    torch.testing.assert_close(torch.cat((a_lps, b_lps))[1:], lps[1:])
    # the greedy logprob is never below the fed token's
    fed, _ = chunk_logprobs(logits, tokens, None)
    assert bool((lps[1:] >= fed[1:] - 1e-6).all())
