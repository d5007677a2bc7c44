"""What the scheduler remembers so that no request is lost when another process dies.

The scheduler is the one place that holds every request's tokens, so it is where streams are rebuilt from:
- `StreamLog` keeps, per request, the StreamOpen it sent and every row it emitted, and for a short grace period
  after the end (bounded count), so that a `Resync` (http saw a stall, a detokenizer saw a gap or an unknown
  request) is answered with the whole stream from offset 0 (`TokenBatch.reset`); decoding is deterministic, so
  the rebuilt rows equal the old ones and http drops those it already delivered, by index.
- `Forgotten` remembers request ids aborted before they arrived here (the Abort overtook the request, or http
  gave up before Accepted) and ended ids, so that a late or resubmitted request with such an id never runs.
Pure bookkeeping, no sockets; tested in tests/services/scheduler/test_recovery.py.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from libs.protocol.messages import StreamOpen, TokenBatch
from libs.runtime.timeouts import FORGET_MAX, FORGET_S, GRACE_MAX, GRACE_S
from services.scheduler.batcher import Emitted
from services.scheduler.token_batch import token_batch


@dataclass
class Stream:
    open: StreamOpen | None = None
    rows: list[Emitted] = field(default_factory=list)
    error: str | None = None  # the request failed with this message (re-sent on a resync)
    ended_at: float | None = None


class StreamLog:
    def __init__(self, grace_s: float = GRACE_S, grace_max: int = GRACE_MAX):
        self.grace_s, self.grace_max = grace_s, grace_max
        self.live: dict[str, Stream] = {}
        self.ended: OrderedDict[str, Stream] = OrderedDict()

    def get(self, request_id: str) -> Stream | None:
        return self.live.get(request_id) or self.ended.get(request_id)

    def record(self, batch: TokenBatch, rows: list[Emitted]) -> None:
        """The rows of one published batch (their StreamOpens, if any, are in `batch.opens`)."""
        for o in batch.opens:
            self.live.setdefault(o.request_id, Stream()).open = o
        for row in rows:
            rid = row.seq.req.request_id
            st = self.live.get(rid)
            if st is None:
                st = self.ended.get(rid)
                if st is not None:
                    self._late(st, row)
                    continue
                st = self.live[rid] = Stream()
            st.rows.append(row)
            if row.finish:
                self.end(rid)

    @staticmethod
    def _late(st: Stream, row: Emitted) -> None:
        """A row of an ended stream: one that its end row overtook (an offset below the end's) takes its place
        before the end, so that a replay never has a hole (which would make the detokenizer ask again, and be
        answered with the same hole); anything past the end (a second end row, tokens generated before a
        stop-sequence hit was heard) is not part of the stream."""
        last = st.rows[-1] if st.rows else None
        if last is None or not last.finish or row.offset >= last.offset:
            return
        at = len(st.rows) - 1
        while at > 0 and st.rows[at - 1].offset > row.offset:
            at -= 1
        if at > 0 and st.rows[at - 1].offset == row.offset:
            return  # already there
        st.rows.insert(at, row)

    def fail(self, request_id: str, message: str) -> None:
        """The request failed with `message`: kept with its stream (live, or just ended by its failed row)."""
        st = self.get(request_id)
        if st is None:
            st = self.live[request_id] = Stream()
        st.error = message
        self.end(request_id)

    def end(self, request_id: str) -> None:
        st = self.live.pop(request_id, None)
        if st is None:
            return
        st.ended_at = time.monotonic()
        self.ended[request_id] = st
        self.expire()

    def expire(self) -> None:
        now = time.monotonic()
        while self.ended:
            rid, st = next(iter(self.ended.items()))
            if len(self.ended) <= self.grace_max and now - st.ended_at < self.grace_s:
                break
            del self.ended[rid]

    def replay(self, replica: int, request_id: str) -> TokenBatch | None:
        """The whole stream so far as one reset batch, or None when nothing was streamed yet."""
        st = self.get(request_id)
        if st is None or st.open is None or not st.rows:
            return None
        batch = token_batch(replica, st.rows)  # every row's sequence is opened: no new opens
        batch.opens, batch.reset = [st.open], [request_id]
        return batch


class Forgotten:
    """Request ids that must not run if they arrive (aborted before arrival), for a while."""

    def __init__(self, keep_s: float = FORGET_S, keep_max: int = FORGET_MAX):
        self.keep_s, self.keep_max = keep_s, keep_max
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        now = time.monotonic()
        while self._ids:
            rid, t = next(iter(self._ids.items()))
            if len(self._ids) <= self.keep_max and now - t < self.keep_s:
                break
            del self._ids[rid]

    def __contains__(self, request_id: str) -> bool:
        t = self._ids.get(request_id)
        return t is not None and time.monotonic() - t < self.keep_s
