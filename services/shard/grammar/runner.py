"""The model runner's side of structured output: the served model's `Constraints` (services/shard/grammar/matchers.py),
built on a thread at start, opened per sequence, and one step's `constrain` hook for sampling (`GrammarMask`)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from services.shard.grammar.matchers import Constraints, Pick

log = logging.getLogger("switchyard.shard.grammar")
REPORT_S = 10.0  # how often the shard logs its grammar totals while constrained rows run


class GrammarMask:
    """One step's `constrain` for sampling: called with the scores, it masks every constrained row; `split` leaves
    the rows that may be chosen among their allowed ids alone (sampling.choose's sparse rows) and returns those ids."""

    def __init__(
        self, cons: Constraints, keys: list[int | None], errors: dict[int, str], drafts: list[Pick | None] | None = None
    ) -> None:
        self._cons, self._keys, self._errors, self._drafts = cons, keys, errors, drafts

    def __call__(self, scores: torch.Tensor) -> None:
        self.split(scores, ())

    def split(self, scores: torch.Tensor, sparse_ok: Sequence[int]) -> dict[int, np.ndarray]:
        sparse: dict[int, np.ndarray] = {}
        for e in self._cons.apply(scores, self._keys, sparse_ok, sparse, self._drafts):
            self._errors[int(e.key)] = e.message
        return sparse


class ShardGrammars:
    """The model runner's side: one `Constraints` for the served model, opened per sequence by its handle.

    It is built on a thread when the runner starts (from the model folder's tokenizer.json and all of the model's
    EOS ids; a large vocabulary takes seconds, with the slices that speed up its masks), so the first constrained
    step does not wait for it. llguidance holds the GIL while it builds, so the runner's start does wait (the
    thread's start returns only once the build is done). Steps without a constrained row do no more than `len()`
    here.
    """

    def __init__(self, model_dir: str, eos_ids: Sequence[int], enabled: bool = True, fill: str = "ahead") -> None:
        """`fill` (Settings.grammar_fill): "ahead", masks filled on a worker beside the forward pass, or "inline", on
        the step's path with every core."""
        path = os.path.join(model_dir, "tokenizer.json")
        self._reported = (0, time.monotonic())  # (constrained steps, when) at the last totals line
        self._cons: Constraints | None = None
        self._future: concurrent.futures.Future | None = None
        if enabled and os.path.exists(path) and eos_ids:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-load")
            ahead = fill != "inline"
            threads = None if ahead else os.cpu_count()
            self._future = pool.submit(Constraints.from_file, path, list(eos_ids), ahead=ahead, threads=threads)
            pool.shutdown(wait=False)

    @property
    def constraints(self) -> Constraints | None:
        return self._cons

    def open(self, seq: int, grammar: str, replay: Sequence[int]) -> None:
        if self._cons is None:
            if self._future is None:
                raise ValueError("a grammar reached a shard without structured output (no tokenizer.json or EOS ids)")
            self._cons = self._future.result()
        self._cons.open(seq, grammar, replay)  # an error is reported by apply(), for this row alone

    def discard(self, seq: int) -> None:
        if self._cons is not None:
            self._cons.discard(seq)
            if not len(self._cons):  # the last constrained sequence ended: its steps are in the totals now
                self.report(force=True)

    def report(self, force: bool = False) -> str | None:
        """Log the grammar work's running totals (cumulative, so a reader subtracts two lines to get a run's
        share), every REPORT_S while constrained rows run, and when the last one ends; returns the line."""
        cons, (steps, when) = self._cons, self._reported
        now = time.monotonic()
        if cons is None or cons.stats["steps"] == steps or not (force or now - when >= REPORT_S):
            return None
        self._reported = (cons.stats["steps"], now)
        totals = " ".join(f"{k}={v}" for k, v in cons.stats.items())
        seconds = " ".join(f"{k}_s={v:.4f}" for k, v in cons.seconds.items())
        line = f"grammar totals: {totals} {seconds}"
        log.info("%s", line)
        return line

    def clear(self) -> None:
        if self._cons is not None:
            self._cons.clear()

    def keys(self, seqs: Sequence[int]) -> list[int | None] | None:
        """Per sampled row its handle if it is constrained, else None; None when no row is (the common case)."""
        cons = self._cons
        if cons is None or not len(cons):
            return None
        keys = [s if s in cons else None for s in seqs]
        return keys if any(k is not None for k in keys) else None

    def mask(
        self, keys: list[int | None], errors: dict[int, str], drafts: list[Pick | None] | None = None
    ) -> GrammarMask:
        """The `constrain` step of sampling: masks the rows' scores (a drafted row's picks after their drafts), and
        records the rows left with no token."""
        return GrammarMask(self._cons, keys, errors, drafts)

    def advance(self, keys: list[int | None], tokens: Sequence[int], errors: dict[int, str]) -> None:
        """The sampled tokens move the matchers on (and the next masks start filling on the worker)."""
        for e in self._cons.advance(keys, tokens):
            errors[int(e.key)] = e.message
        self.report()
