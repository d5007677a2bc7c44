"""The batcher carries a request's grammar to the shard: with the tokens generated so far on a recompute (after
preemption or a shard restart), and counts the constrained rows of each step."""

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import TokenizedRequest as Req
from libs.protocol.params import SamplingParams
from services.scheduler.batcher import Batcher
from tests.services.scheduler.test_batcher import EOS, result


def req(rid: str, prompt_len: int, max_new: int, grammar: str = "") -> Req:
    ids = np.arange(10, 10 + prompt_len, dtype=np.int32)
    return Req(
        request_id=rid,
        ingress=0,
        input_ids=ids,
        sampling=SamplingParams(),
        max_new_tokens=max_new,
        grammar=grammar,
        grammar_kind="regex" if grammar else "",
    )


def test_the_grammar_goes_with_the_sequence_and_its_tokens_on_a_recompute():
    b = Batcher(100, max_batch_size=8, max_batch_prefill_tokens=64, eos_ids={EOS})
    b.add(req("g", 5, 10, grammar="G"))
    b.add(req("u", 5, 10))
    p = codec.decode(codec.encode(b.plan(1)))  # as the shard receives it
    assert [(n.grammar, n.grammar_ids) for n in p.new] == [("G", []), ("", [])]
    assert b.step_constrained == 1 and b.counters["constrained_rows"] == 1
    g, u = (int(s) for s in p.seqs)
    b.apply(result(p, {g: 40, u: 41}))
    p = b.plan(2)
    b.apply(result(p, {g: 42, u: 43}))
    assert b.step_constrained == 1 and b.counters["constrained_rows"] == 2
    b.requeue_running()  # the shard restarted: both are fed again from their prompts
    p = codec.decode(codec.encode(b.plan(3)))
    replayed = {n.grammar: n.grammar_ids for n in p.new}
    assert replayed == {"G": [40, 42], "": []}  # the matcher is rebuilt from what was generated
    assert b.step_constrained == 1
