"""A request's state in the scheduler (`Sequence`) and one token row for the detokenizer (`Emitted`); the batcher
(services/scheduler/batcher.py) decides what runs, these hold what it decided."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from libs.protocol.messages import TokenizedRequest
from services.scheduler.drafting import RowStats


@dataclass
class Sequence:
    seq: int  # small integer handle shared with the shard (a new one each time it is (re)admitted)
    req: TokenizedRequest
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    opened: bool = False  # the detokenizer has been told about it
    # with sampling.prompt_logprobs: the logprob of each prompt token so far, gathered over prefill chunks
    # until the StreamOpen carries them (then dropped: the detokenizer keeps them)
    prompt_logprobs: list[float] = field(default_factory=list)
    # and the greedy token (raw argmax) at each of those positions, with its logprob
    prompt_greedy: list[tuple[int, float]] = field(default_factory=list)
    computed: int = 0  # tokens (prompt, then generated) whose KV is in its blocks, once the planned step ran
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its first full blocks (lookup, index)
    registered: int = 0  # its first blocks that are in the prefix index (or came from it)
    planned_blocks: int = 0  # its blocks the shard has been told about
    preempted: int = 0  # times it gave its blocks back
    drafting: RowStats = field(default_factory=RowStats)  # speculative decoding: how well its drafts do
    rank: tuple = ()  # --scheduling-policy priority: its place in line, lower first (priority.py)

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)

    @property
    def total(self) -> int:
        """Tokens the sequence consists of now: prompt + generated (the last one not yet fed)."""
        return self.prompt_len + len(self.output)

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of prompt + generated."""
        n = self.prompt_len
        if end <= n:
            return self.req.input_ids[start:end]
        gen = np.asarray(self.output[max(0, start - n) : end - n], dtype=np.int32)
        return gen if start >= n else np.concatenate((self.req.input_ids[start:], gen))

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

    def take_prompt_greedy(self) -> tuple[list[int], list[float]]:
        """For the StreamOpen: the greedy token at every prompt position and its logprob (-1 / NaN where the
        shard sent none), or ([], []) when the request asked for no prompt logprobs or the shard sent none."""
        if not self.req.sampling.prompt_logprobs or not self.prompt_greedy:
            self.prompt_greedy = []
            return [], []
        n = self.prompt_len
        greedy = self.prompt_greedy[:n] + [(-1, math.nan)] * max(0, n - len(self.prompt_greedy))
        self.prompt_greedy = []
        return [i for i, _ in greedy], [lp for _, lp in greedy]


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
