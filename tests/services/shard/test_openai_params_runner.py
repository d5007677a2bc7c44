"""logit_bias, min_p and the min_tokens mask through the shard and the scheduler on a tiny model (bench/engine.py):
the mask counts each pick's own position, so a short sequence never ends while the EOS bias would make it, and the
answers are the same with speculative drafts (right and spoiled ones) as without."""

from __future__ import annotations

import numpy as np

from libs.protocol.params import SamplingParams
from services.shard.model_runner import ModelRunner
from tests.services.shard.test_verify import drafted_run
from tests.tiny_models import EOS, prompts_for


def test_min_tokens_logit_bias_min_p_with_and_without_drafts(tiny_dirs):
    model_dir = tiny_dirs["llama"]
    prompts = prompts_for(model_dir)[1:5]
    k = 5
    params = [
        # EOS forced by its bias, held back for k tokens: k tokens, then EOS
        SamplingParams(logit_bias={EOS: 100.0}, min_length=len(prompts[0]) + k, min_length_ids=[EOS], min_tokens=k),
        SamplingParams(do_sample=True, seed=3, min_p=0.2, temperature=1.4, top_n_tokens=2),
        SamplingParams(logit_bias={500: 100.0}),  # forced every step
        SamplingParams(do_sample=True, seed=4, logit_bias={EOS: -100.0, 7: 3.0}, repetition_penalty=1.2),
    ]
    runner = ModelRunner(str(model_dir), num_blocks=96, block_size=4)
    plain, plain_lps, plain_tops, _ = drafted_run(runner, prompts, 16, params)
    assert len(plain[0]) == k + 1 and plain[0][-1] == EOS and EOS not in plain[0][:-1]
    assert plain[2] == [500] * 16
    assert EOS not in plain[3]
    got, lps, tops, (drafted, accepted) = drafted_run(runner, prompts, 16, params, plain, k=3)
    assert got == plain and tops == plain_tops
    np.testing.assert_allclose(np.concatenate(list(lps.values())), np.concatenate(list(plain_lps.values())), atol=1e-5)
    assert 0 < accepted < drafted
