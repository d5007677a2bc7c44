"""Emitted rows → the columnar TokenBatch one detokenizer shard receives (pure, tested on its own)."""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import PROMPT_TAIL, StreamOpen, TokenBatch
from services.scheduler.batcher import Emitted


def stream_open(row: Emitted, replica: int) -> StreamOpen:
    """What the detokenizer must know before the request's first row; marks the sequence as opened."""
    s = row.seq
    s.opened = True
    req = s.req
    prompt_ids, prompt_logprobs = s.take_prompt_details()
    greedy_ids, greedy_logprobs = s.take_prompt_greedy()
    return StreamOpen(
        request_id=req.request_id,
        ingress=req.ingress,
        replica=replica,
        input_length=len(req.input_ids),
        prompt_tail=req.input_ids[-PROMPT_TAIL:].tolist(),
        stop=req.stop,
        seed=req.seed,
        prompt_ids=prompt_ids,
        prompt_logprobs=prompt_logprobs,
        prompt_greedy_ids=greedy_ids,
        prompt_greedy_logprobs=greedy_logprobs,
        min_tokens=req.sampling.min_tokens,
    )


def token_batch(replica: int, rows: list[Emitted]) -> TokenBatch:
    """One batch for rows bound to the same detokenizer, opening the requests seen for the first time."""
    n = len(rows)
    opens = [stream_open(row, replica) for row in rows if not row.seq.opened]
    if any(row.top_ids for row in rows):
        top_counts = np.fromiter((len(row.top_ids) for row in rows), np.int32, n)
        top_ids = np.asarray([i for row in rows for i in row.top_ids], np.int32)
        top_logprobs = np.asarray([lp for row in rows for lp in row.top_logprobs], np.float32)
    else:  # no row has alternatives: all three frames stay empty
        top_counts = top_ids = np.zeros(0, np.int32)
        top_logprobs = np.zeros(0, np.float32)
    return TokenBatch(
        replica=replica,
        request_ids=[row.seq.req.request_id for row in rows],
        opens=opens,
        offsets=np.fromiter((row.offset for row in rows), np.uint32, n),
        token_ids=np.fromiter((row.token_id for row in rows), np.int32, n),
        logprobs=np.fromiter((row.logprob for row in rows), np.float32, n),
        finish=np.fromiter((row.finish for row in rows), np.uint8, n),
        top_counts=top_counts,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )
