"""A detokenizer that lost its state asks for a resync, and a reset batch rebuilds the stream exactly."""

import numpy as np

from libs.protocol.messages import StreamOpen, TokenBatch
from services.detokenizer.__main__ import Detokenizer
from tests.detokenizer.test_incremental import build_tokenizer


def batch(rid, offsets, tokens, finish=None, opens=(), reset=()):
    n = len(offsets)
    return TokenBatch(
        replica=1,
        request_ids=[rid] * n,
        opens=list(opens),
        reset=list(reset),
        offsets=np.asarray(offsets, np.uint32),
        token_ids=np.asarray(tokens, np.int32),
        logprobs=np.zeros(n, np.float32),
        finish=np.asarray(finish or [0] * n, np.uint8),
        top_counts=np.zeros(0, np.int32),
        top_ids=np.zeros(0, np.int32),
        top_logprobs=np.zeros(0, np.float32),
    )


def opened(rid):
    return StreamOpen(request_id=rid, ingress=2, replica=1, input_length=3, prompt_tail=[1, 2, 3])


def rows_of(out):
    return [(r.index, r.token_id, r.text) for r in out.get(2, [])]


def test_unknown_request_and_gaps_ask_for_a_resync_once():
    d = Detokenizer(build_tokenizer())
    d.handle(batch("r", [4], [40]))  # never opened here (a restarted detokenizer)
    d.handle(batch("r", [5], [41]))  # asked a moment ago: rate-limited
    assert d.wanted == [(1, "r")]
    d.wanted.clear()
    d.handle(batch("s", [0], [40], opens=[opened("s")]))
    d.handle(batch("s", [2], [42]))  # offset 1 went missing
    assert d.wanted == [(1, "s")]


def test_reset_batch_rebuilds_the_same_rows():
    tok = [40, 41, 42, 43]
    whole = Detokenizer(build_tokenizer())
    want = rows_of(whole.handle(batch("r", [0, 1, 2, 3], tok, [0, 0, 0, 1], opens=[opened("r")]))[0])
    d = Detokenizer(build_tokenizer())
    d.handle(batch("r", [0, 1], tok[:2], opens=[opened("r")]))
    d.handle(batch("r", [1], tok[1:2]))  # a duplicate: nothing
    out, _ = d.handle(batch("r", [0, 1, 2, 3], tok, [0, 0, 0, 1], opens=[opened("r")], reset=["r"]))
    assert rows_of(out) == want and out[2][-1].final.generated_text == whole_text(want)
    again, _ = d.handle(batch("r", [0, 1, 2, 3], tok, [0, 0, 0, 1], opens=[opened("r")], reset=["r"]))
    assert rows_of(again) == want  # also after the end (a resync of a just-finished request)


def whole_text(rows):
    return "".join(text for _, _, text in rows)
