"""A detokenizer that lost its state asks for a resync, and a reset batch rebuilds the stream exactly."""

import numpy as np

from libs.protocol.messages import FINISH_ABORTED, StreamOpen, TokenBatch
from services.detokenizer.__main__ import Detokenizer
from tests.services.detokenizer.test_incremental import build_tokenizer


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
    assert asked(d) == [(1, "r", "unopened")]
    d.wanted.clear()
    d.handle(batch("s", [0], [40], opens=[opened("s")]))
    d.handle(batch("s", [2], [42]))  # offset 1 went missing
    assert asked(d) == [(1, "s", "gap")] and (d.wanted[0].offset, d.wanted[0].expected) == (2, 1)


def asked(d):
    return [(w.replica, w.request_id, w.reason) for w in d.wanted]


def test_a_resync_answer_never_asks_again():
    """A client left while its last row waited to be published, and the scheduler sent the abort's end row ahead
    of that row: the detokenizer saw the end past a gap (a real gap, from where it stands: it asks), and the
    scheduler's stream log had lost the overtaken row, so its answer had the same hole. That answer must not be
    asked about again (it would be answered the same way, for as long as the stream is kept): the hole is only
    recorded (and logged as the scheduler's fault)."""
    d = Detokenizer(build_tokenizer())
    d.handle(batch("r", [0, 1], [40, 41], opens=[opened("r")]))
    d.handle(batch("r", [3], [-1], finish=[FINISH_ABORTED]))  # the end of offset 3 overtook the row of offset 2
    assert asked(d) == [(1, "r", "gap")] and d.wanted[0].finish == FINISH_ABORTED
    d.wanted.clear()
    d._asked.clear()  # as if RESYNC_EVERY went by before the answer came (a busy machine)
    holed = batch("r", [0, 1, 3], [40, 41, -1], [0, 0, FINISH_ABORTED], opens=[opened("r")], reset=["r"])
    out, _ = d.handle(holed)
    assert d.wanted == [] and [(h.request_id, h.offset, h.expected) for h in d.holes] == [("r", 3, 2)]
    assert [r.index for r in out[2]] == [1, 2]  # what the answer holds is rebuilt all the same
    d.holes.clear()
    whole = batch("r", [0, 1, 2, 3], [40, 41, 42, -1], [0, 0, 0, FINISH_ABORTED], opens=[opened("r")], reset=["r"])
    out, _ = d.handle(whole)  # a whole answer (the scheduler keeps rows in order now) ends the stream
    assert d.wanted == [] and d.holes == [] and "r" not in d.streams and out[2][-1].final.finish_reason == "aborted"


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
