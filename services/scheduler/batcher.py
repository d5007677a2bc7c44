"""Continuous batching: which sequences run in the next step, and what their tokens mean.

Pure bookkeeping, no sockets (the loop in `__main__` does IO), so it is tested on its own.
Policy, TGI-like for now: FIFO admission; a request is admitted only when KV blocks for its
whole length (prompt + max_new_tokens) are free, so a running request never runs out of KV and
nothing needs preempting; new prefills join the running decodes in the same forward, within
`max_batch_prefill_tokens` and `max_batch_size`; a finished request leaves at once.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from libs.protocol.messages import (
    FINISH_ABORTED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_NONE,
    NewSequence,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from services.scheduler.block_allocator import BlockAllocator, blocks_for


@dataclass
class Sequence:
    seq: int  # small integer handle shared with the shard
    req: TokenizedRequest
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    opened: bool = False  # the detokenizer has been told about it
    # with sampling.prompt_logprobs: the logprob of each prompt token so far, gathered over prefill chunks
    # until the StreamOpen carries them (then dropped: the detokenizer keeps them)
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)

    def take_prompt_details(self) -> tuple[list[int], list[float]]:
        """For the StreamOpen: all prompt ids and their logprobs, or ([], []) when the request asked for none.

        A logprob the shard never sent (a short or missing run) is NaN, which the detokenizer reports as null;
        the gathered list is handed over once and dropped here.
        """
        if not self.req.sampling.prompt_logprobs:
            return [], []
        n = self.prompt_len
        logprobs = self.prompt_logprobs[:n] + [math.nan] * max(0, n - len(self.prompt_logprobs))
        self.prompt_logprobs = []
        return self.req.input_ids.tolist(), logprobs


@dataclass
class Emitted:
    """One row for the detokenizer: a sampled token, or just an end (token_id -1)."""

    seq: Sequence
    offset: int
    token_id: int
    logprob: float
    finish: int
    top_ids: list[int] = field(default_factory=list)  # the step's alternatives (top_n_tokens), best first
    top_logprobs: list[float] = field(default_factory=list)


def _frame(value) -> list:
    """A result frame as a list; a hand-built StepResult may leave an optional frame None."""
    return [] if value is None else value.tolist()


class Batcher:
    def __init__(self, num_blocks: int, *, max_batch_size: int, max_batch_prefill_tokens: int, eos_ids: set[int]):
        self.allocator = BlockAllocator(num_blocks)
        self.max_batch_size = max_batch_size
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.eos_ids = eos_ids
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.by_request: dict[str, Sequence] = {}
        self._to_drop: list[int] = []  # finished seqs the shard has not been told about
        self._handles = itertools.count(1)
        self.counters = {"steps": 0, "prefill_rows": 0, "decode_rows": 0, "joined_steps": 0, "generated": 0}

    def add(self, req: TokenizedRequest) -> None:
        if req.request_id in self.by_request:
            return  # a duplicate delivery: the request is already here
        s = Sequence(next(self._handles), req)
        self.by_request[req.request_id] = s
        self.waiting.append(s)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def plan(self, step: int) -> StepPlan | None:
        """The next step: every running decode, plus the waiting prefills that fit."""
        seqs, num_tokens, context_lens, token_ids = [], [], [], []
        for s in self.running.values():
            seqs.append(s.seq)
            num_tokens.append(1)
            context_lens.append(s.prompt_len + len(s.output) - 1)
            token_ids.append(s.output[-1])
        decodes = len(seqs)
        new, blocks, budget = [], {}, self.max_batch_prefill_tokens
        while self.waiting and len(self.running) < self.max_batch_size:
            s = self.waiting[0]
            need = blocks_for(s.prompt_len + s.req.max_new_tokens)
            if s.prompt_len > budget or not self.allocator.can_allocate(need):
                break  # FIFO: the head waits until it fits, as in TGI
            self.waiting.popleft()
            budget -= s.prompt_len
            s.blocks = self.allocator.allocate(need)
            self.running[s.seq] = s
            new.append(NewSequence(s.seq, s.req.sampling))
            blocks[s.seq] = s.blocks
            seqs.append(s.seq)
            num_tokens.append(s.prompt_len)
            context_lens.append(0)
            token_ids.extend(s.req.input_ids.tolist())
        if not seqs:
            return None
        prefills = len(seqs) - decodes
        c = self.counters
        c["steps"] += 1
        c["prefill_rows"] += prefills
        c["decode_rows"] += decodes
        c["joined_steps"] += bool(prefills and decodes)
        finished, self._to_drop = self._to_drop, []
        return StepPlan(
            step=step,
            new=new,
            blocks=blocks,
            finished=finished,
            seqs=np.asarray(seqs, np.int32),
            num_tokens=np.asarray(num_tokens, np.int32),
            context_lens=np.asarray(context_lens, np.int32),
            token_ids=np.asarray(token_ids, np.int32),
            sample=np.ones(len(seqs), np.uint8),
        )

    def apply(self, result: StepResult) -> list[Emitted]:
        """Append the sampled tokens; finish by length (checked first, as TGI) or EOS."""
        self._gather_prompt_logprobs(result)
        counts = _frame(result.top_counts)  # empty: no row has alternatives
        top_ids, top_logprobs = _frame(result.top_ids), _frame(result.top_logprobs)
        rows, start = [], 0
        for i, (seq, token, logprob) in enumerate(
            zip(result.seqs.tolist(), result.token_ids.tolist(), result.logprobs.tolist())
        ):
            end = start + (counts[i] if counts else 0)
            alt_ids, alt_logprobs = top_ids[start:end], top_logprobs[start:end]
            start = end
            s = self.running.get(seq)
            if s is None:
                continue  # finished (aborted) while the step ran
            s.output.append(token)
            self.counters["generated"] += 1
            if len(s.output) >= s.req.max_new_tokens:
                finish = FINISH_LENGTH
            elif token in self.eos_ids:
                finish = FINISH_EOS
            else:
                finish = FINISH_NONE
            rows.append(Emitted(s, len(s.output) - 1, token, logprob, finish, alt_ids, alt_logprobs))
            if finish:
                self._release(s)
        return rows

    def _gather_prompt_logprobs(self, result: StepResult) -> None:
        """Append each fed prompt chunk's logprobs to its sequence (only sequences that asked send any)."""
        logprobs, start = _frame(result.prompt_logprobs), 0
        for seq, count in zip(_frame(result.prompt_seqs), _frame(result.prompt_counts)):
            s = self.running.get(seq)
            if s is not None and not s.opened:  # after the open they could no longer reach the detokenizer
                s.prompt_logprobs.extend(logprobs[start : start + count])
            start += count

    def finish(self, request_id: str, code: int = FINISH_ABORTED) -> Emitted | None:
        """End a request from outside (abort, stop sequence, failure); the end row, if one is due."""
        s = self.by_request.get(request_id)
        if s is None:
            return None
        if s.seq in self.running:
            self._release(s)
        else:
            self.waiting.remove(s)
            del self.by_request[request_id]
        return Emitted(s, len(s.output), -1, 0.0, code)

    def _release(self, s: Sequence) -> None:
        del self.running[s.seq]
        del self.by_request[s.req.request_id]
        self.allocator.release(s.blocks)
        s.blocks = []
        self._to_drop.append(s.seq)
