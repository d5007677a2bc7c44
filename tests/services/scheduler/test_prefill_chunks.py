"""The prefill cap while decodes run (`max_prefill_tokens_while_decoding`): a long prompt that arrives among
running streams is fed in chunks of at most the cap, in the same steps as every running decode; with no stream
decoding the whole `max_batch_prefill_tokens` budget is used; the greedy output is the same as without the cap.
And the saturation rule (`prefill_saturation_tokens`): a step whose prefill holds that many tokens takes no
further prompt."""

import numpy as np
import pytest

from libs.protocol import codec
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepResult
from services.scheduler.batcher import Batcher

EOS = 2
STREAMS = 16


def req(rid: str, prompt_len: int, max_new: int, first: int = 10) -> Req:
    ids = np.arange(first, first + prompt_len, dtype=np.int32)
    return Req(request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(), max_new_tokens=max_new)


def sample_all(b: Batcher, plan) -> None:
    """Token 7 for every row the plan samples (a running stream's next token, a finished prompt's first)."""
    seqs = [s for s, want in zip(plan.seqs.tolist(), plan.sample.tolist()) if want]
    res = StepResult(
        step=plan.step,
        seqs=np.array(seqs, np.int32),
        token_ids=np.full(len(seqs), 7, np.int32),
        logprobs=np.zeros(len(seqs), np.float32),
    )
    b.apply(codec.decode(codec.encode(res)))


def long_prompt_among_streams(cap: int, prompt_len: int = 1000) -> tuple[Batcher, list[tuple[int, int]]]:
    """16 streams decoding, then a `prompt_len` prompt; (batcher, per step while it was fed: (tokens of it fed,
    decode rows)). It joins at once (max_waiting_tokens=0), as it would after TGI's wait."""
    b = Batcher(
        2000,
        max_batch_size=32,
        max_batch_prefill_tokens=4096,
        eos_ids={EOS},
        max_waiting_tokens=0,
        max_prefill_tokens_while_decoding=cap,
    )
    for i in range(STREAMS):
        b.add(req(f"s{i}", 8, 200, first=10 + 100 * i))
    step = 1
    sample_all(b, b.plan(step))  # all 16 prefilled together; from here on they decode
    b.add(req("long", prompt_len, 1, first=5000))
    long_seq, fed = None, []
    while True:
        step += 1
        plan = b.plan(step)
        if long_seq is None and len(plan.new) == 1:
            long_seq = plan.new[0].seq
        rows = dict(zip(plan.seqs.tolist(), plan.num_tokens.tolist()))
        if long_seq in rows:
            fed.append((rows.pop(long_seq), sum(n == 1 for n in rows.values())))
        sample_all(b, plan)
        if long_seq is not None and long_seq not in b.running:
            return b, fed


@pytest.mark.parametrize("cap", [64, 250])
def test_a_long_prompt_is_fed_in_capped_chunks_alongside_every_decode(cap):
    b, fed = long_prompt_among_streams(cap)
    assert sum(n for n, _ in fed) == 1000 and len(fed) == -(-1000 // cap)  # all of it, at most the cap a step
    assert all(n <= cap for n, _ in fed), fed
    assert all(decodes == STREAMS for _, decodes in fed), fed  # every stream got its token in each of those steps
    assert b.counters["chunked_prefills"] == 1  # admitted with a first chunk only: the cap fired


def test_without_the_cap_the_prompt_goes_in_one_step():
    b, fed = long_prompt_among_streams(0)
    assert fed == [(1000, STREAMS)] and b.counters["chunked_prefills"] == 0


def test_the_cap_does_not_apply_when_nothing_decodes():
    b = Batcher(
        2000, max_batch_size=8, max_batch_prefill_tokens=4096, eos_ids={EOS}, max_prefill_tokens_while_decoding=64
    )
    b.add(req("alone", 1000, 1))
    plan = b.plan(1)
    assert plan.num_tokens.tolist() == [1000] and b.counters["chunked_prefills"] == 0


def burst(saturation: int, prompts: list[int]) -> tuple[Batcher, list[list[int]]]:
    """Prompts of `prompts` tokens arriving at once (one new token each); per step, the prompt tokens of each row."""
    b = Batcher(
        4000, max_batch_size=16, max_batch_prefill_tokens=4096, eos_ids={EOS}, prefill_saturation_tokens=saturation
    )
    for i, n in enumerate(prompts):
        b.add(req(f"p{i}", n, 1, first=10 + 3000 * i))
    steps = []
    while b.has_work():
        plan = b.plan(len(steps) + 1)
        steps.append(plan.num_tokens.tolist())
        sample_all(b, plan)
    return b, steps


def test_a_saturated_step_takes_no_further_prompt():
    # TGI's packing fills the 4096 budget: the first prompt's token waits for two prompts and a chunk of a third
    b, steps = burst(0, [2000] * 4)
    assert steps == [[2000, 2000, 96], [1904, 2000]] and b.counters["saturated_steps"] == 0
    # saturated at 512 prompt tokens: one 2k prompt a step, the first one's token after one prefill, not two
    b, steps = burst(512, [2000] * 4)
    assert steps == [[2000]] * 4 and b.counters["saturated_steps"] == 3
    # short prompts still share a step until it holds 512 tokens; a prompt that starts is never cut by the rule
    b, steps = burst(512, [200, 200, 200, 200, 100])
    assert steps == [[200, 200, 200], [200, 100]] and b.counters["saturated_steps"] == 1


def test_saturation_counts_a_running_chunked_prefill():
    # a 6k prompt is chunked by the 4096 budget; its second chunk (1904 tokens) saturates that step: the waiting
    # prompt starts after it instead of taking the 2k left beside it
    b, steps = burst(512, [6000, 300])
    assert steps == [[4096], [1904], [300]]
    b, steps = burst(0, [6000, 300])
    assert steps == [[4096], [1904, 300]]
