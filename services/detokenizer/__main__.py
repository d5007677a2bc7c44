"""`python -m services.detokenizer`: token rows in (tok.<k>), text rows out (out.<ingress>).

A row for a request it has no stream of (this process restarted, or the open was lost with a router restart)
or a row past a gap makes it ask the scheduler for a `Resync` (`Detokenizer.wanted`; logged with the offsets, and
counted in switchyard_resyncs_total); the reset batch that answers rebuilds the stream from offset 0, and a gap
inside that answer is only logged (asking again would get the same answer). Rows arrive in offset order, so a gap
means lost rows, never normal traffic. docs/recovery.md tells the whole protocol.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from libs.protocol import Addresses, topics
from libs.protocol.messages import (
    FINISH_NAMES,
    FinalInfo,
    Resync,
    StopHit,
    StreamOpen,
    TextBatch,
    TextRow,
    TokenBatch,
)
from libs.runtime import bus, metrics, service, tracing
from libs.runtime.settings import Settings
from libs.runtime.timeouts import FORGET_AFTER, RESYNC_EVERY
from services.detokenizer.details import TokenTexts
from services.detokenizer.formats import keeps_special_tokens
from services.detokenizer.incremental import IncrementalDecoder
from services.detokenizer.stops import StopMatcher

ROLE = "detokenizer"


@dataclass
class Want:
    """A resync to ask for, and the row that showed it is needed (for the log and the metric)."""

    replica: int
    request_id: str
    offset: int  # the row's offset
    expected: int | None  # the offset the stream was at; None: a request never opened here
    finish: int  # the row's finish code (an end row past a gap shows an end that overtook rows)

    @property
    def reason(self) -> str:
        return "unopened" if self.expected is None else "gap"

    def __str__(self) -> str:
        at = "never opened here" if self.expected is None else f"stream at offset {self.expected}"
        return f"{self.reason}: row offset {self.offset}, {at}, finish {self.finish}"


@dataclass
class Stream:
    open: StreamOpen
    decoder: IncrementalDecoder
    stops: StopMatcher
    next_offset: int = 0
    span: Any = None  # the detokenizer's span of this request, from its open to its end (tracing on only)


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, keep_special: bool = False):
        self.tokenizer = tokenizer
        self.keep_special = keep_special  # the served chat format is written in special tokens (formats.py)
        self.texts = TokenTexts(tokenizer)
        self.streams: dict[str, Stream] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.tokens = 0
        self.wanted: list[Want] = []  # resyncs to ask for, drained by the loop
        self.holes: list[Want] = []  # gaps inside a reset batch (a scheduler bug: logged, never asked again)
        self._asked: dict[str, float] = {}  # request id → when we last asked

    def _want(self, want: Want) -> None:
        rid, now = want.request_id, time.monotonic()
        if now - self._asked.get(rid, 0.0) < RESYNC_EVERY:
            return
        if len(self._asked) > FORGET_AFTER:
            self._asked = {k: t for k, t in self._asked.items() if now - t < RESYNC_EVERY}
        self._asked[rid] = now
        self.wanted.append(want)

    def handle(self, batch: TokenBatch) -> tuple[dict[int, list[TextRow]], list[StopHit]]:
        """Text rows per ingress, and the stop-sequence hits to tell the scheduler (resyncs wanted: `wanted`)."""
        for rid in batch.reset:  # a resync: rebuild this request from the rows that follow
            st = self.streams.pop(rid, None)
            if st is not None and st.span is not None:
                st.span.end()
            self.ended.pop(rid, None)
        for o in batch.opens:
            if o.request_id not in self.streams and o.request_id not in self.ended:
                decoder = IncrementalDecoder(self.tokenizer, o.prompt_tail, self.keep_special)
                span = (
                    tracing.start("detokenizer", o.traceparent, request_id=o.request_id) if tracing.enabled() else None
                )
                self.streams[o.request_id] = Stream(o, decoder, StopMatcher(o.stop), span=span)
        out: dict[int, list[TextRow]] = defaultdict(list)
        hits = []
        rows = zip(batch.request_ids, batch.offsets.tolist(), batch.token_ids.tolist(), batch.logprobs.tolist())
        # the alternatives' frames (empty when no row has any; None in a batch built by hand)
        counts, top_ids, top_logprobs = (
            [] if f is None else f.tolist() for f in (batch.top_counts, batch.top_ids, batch.top_logprobs)
        )
        end = 0
        for i, ((rid, offset, token, logprob), finish) in enumerate(zip(rows, batch.finish.tolist())):
            start, end = end, end + (counts[i] if counts else 0)
            st = self.streams.get(rid)
            if st is None or offset > st.next_offset:
                want = Want(batch.replica, rid, offset, None if st is None else st.next_offset, finish)
                if rid in batch.reset:  # the answer to a resync has a hole itself: asking again gets the same
                    self.holes.append(want)
                elif rid not in self.ended:  # never opened here, or rows went missing: ask for the whole stream
                    self._want(want)
                continue
            if offset < st.next_offset:
                continue  # a duplicate
            if token < 0:  # an end without a token (abort, failure)
                self._end(rid, FINISH_NAMES.get(finish, "error"))
                if finish in FINISH_NAMES:
                    out[st.open.ingress].append(self._final_row(st, offset, FINISH_NAMES[finish], token, "", 0.0))
                continue
            st.next_offset = offset + 1
            self.tokens += 1
            text = st.decoder.push(token)
            reason = FINISH_NAMES.get(finish)  # None: not finished
            # the matcher sees every token (its tail spans them); a stop counts from min_tokens on, as vLLM's
            stopped = st.stops.push(text) and offset + 1 >= st.open.min_tokens
            if reason is None and stopped:
                reason = "stop_sequence"
                hits.append(StopHit(request_id=rid, generated_tokens=offset + 1))
            if reason is None:
                row = TextRow(
                    request_id=rid,
                    index=offset + 1,
                    token_id=token,
                    text=text,
                    logprob=logprob,
                    special=st.decoder.special(token),
                )
            else:  # the end: bytes still held back go out now, so the deltas add up to the text
                row = self._final_row(st, offset + 1, reason, token, text + st.decoder.flush(), logprob)
                self._end(rid, reason)
            if end > start:
                row.top_tokens = self.texts.alternatives(top_ids[start:end], top_logprobs[start:end])
            out[st.open.ingress].append(row)
        return out, hits

    def _final_row(self, st: Stream, generated: int, reason: str, token: int, text: str, logprob: float) -> TextRow:
        o = st.open
        final = FinalInfo(
            generated_text=st.decoder.final_text(),
            finish_reason=reason,
            generated_tokens=generated,
            input_length=o.input_length,
            seed=o.seed,
            prefill=self.texts.prefill(o),
            prefill_greedy=self.texts.prefill_greedy(o),
        )
        special = token >= 0 and st.decoder.special(token)
        return TextRow(
            request_id=o.request_id,
            index=generated,
            token_id=token,
            text=text,
            logprob=logprob,
            special=special,
            final=final,
        )

    def _end(self, rid: str, reason: str) -> None:
        st = self.streams.pop(rid, None)
        if st is not None and st.span is not None:
            st.span.set_attributes({"finish_reason": reason, "generated_tokens": st.next_offset})
            st.span.end()
        self.ended[rid] = None
        if len(self.ended) > FORGET_AFTER:
            self.ended.popitem(last=False)


def main() -> None:
    def body(settings: Settings, log) -> None:
        keep = keeps_special_tokens(settings)
        detok = Detokenizer(Tokenizer.from_file(os.path.join(settings.model_path, "tokenizer.json")), keep)
        events = bus.EventBus(Addresses.parse(settings.bus), ROLE, settings.index, [topics.tok(settings.index)])
        events.start()
        m = metrics.get()
        log.info("detokenizer %d ready%s", settings.index, " (special tokens kept in the text)" if keep else "")
        while True:
            if events.sub.poll(500):
                got = events.recv()
                if got and isinstance(got[1], TokenBatch):
                    started, tokens = time.perf_counter(), detok.tokens
                    out, hits = detok.handle(got[1])
                    for ingress, rows in out.items():
                        events.publish(topics.out(ingress), TextBatch(rows=rows))
                    for hit in hits:
                        log.debug("stop sequence hit", extra={"request_id": hit.request_id})
                        events.publish(topics.ctl(got[1].replica), hit)
                    for w in detok.wanted:
                        log.info("stream gap: asking for a resync (%s)", w, extra={"request_id": w.request_id})
                        m.resyncs.labels(by=ROLE, reason=w.reason).inc()
                        events.publish(topics.ctl(w.replica), Resync(request_id=w.request_id, ingress=-1))
                    for w in detok.holes:
                        log.warning("a replayed stream has a hole (%s)", w, extra={"request_id": w.request_id})
                    detok.wanted.clear()
                    detok.holes.clear()
                    m.detokenized_tokens.inc(detok.tokens - tokens)
                    # one token batch (a scheduler step's rows for this shard), in and out
                    m.hop_duration.labels(hop="detokenizer").observe(time.perf_counter() - started)
            # its model: the router gives it only that model's requests
            events.heartbeat(running=len(detok.streams), counters={"tokens": detok.tokens}, model=settings.model_id)

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
