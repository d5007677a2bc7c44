"""Grammar-constrained sampling on the shard: one llguidance matcher per constrained sequence.

The tokenizer checked and compiled each grammar already (services.tokenizer.grammar); only its text arrives here,
and fresh matchers are cached by text. `open(seq, grammar, replay)` builds a sequence's matcher, replaying the
tokens it generated (preemption, a restarted shard); `apply(logits, keys, drafts)` runs after the penalties and
before the warpers (TGI's order), sets every token the grammar refuses to -inf, and masks a drafted row's pick j by
the grammar after its first j drafts; `advance(keys, tokens)` moves the matchers on and, with `ahead`, fills the
next step's masks on a worker thread beside the forward pass; `discard(seq)` drops one. EOS is allowed exactly when
the grammar is complete (build the LLTokenizer with all the model's EOS ids). A row left with no allowed token is
reported for its sequence alone and gets EOS as its only choice, so sampling never sees a row of -inf. The model
runner reaches this through services/shard/grammar/runner.py; docs/structured-output.md tells why.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from services.shard.grammar.bitmask import mask_rows, unpack
from services.shard.grammar.regex_states import MaskBudget, RegexStates

Key = Hashable  # the shard's sequence handle
Pick = tuple[Sequence[int], int]  # a drafted row's pick j: (the row's drafts, j); its mask follows drafts[:j]


class RowError(NamedTuple):
    row: int  # the row of the logits passed to apply()
    key: Key
    message: str


class _State:
    __slots__ = ("grammar", "matcher", "version", "error", "regex", "at", "trail")

    def __init__(self, grammar: str, matcher: LLMatcher, error: str | None, regex: RegexStates | None) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self.version = 0  # bumped on every change, so a mask computed ahead is used only for the state it saw
        self.error = error
        # a one-regex grammar: its DFA state (masks remembered per state, regex_states.py), and the states
        # before each consumed token (a rollback restores them)
        self.regex = regex
        self.at = None if regex is None else regex.initial
        self.trail: list[int | None] = []


class Constraints:
    """The constrained sequences of one shard and their token masks."""

    def __init__(
        self,
        tokenizer: LLTokenizer,
        *,
        threads: int | None = None,
        cache_size: int = 64,
        ahead: bool = True,
        regex_mask_bytes: int = 64 << 20,
    ) -> None:
        self.tokenizer = tokenizer
        # ahead: advance() starts the next masks on the worker, beside the forward pass (llguidance's default pool:
        # 80% of the cores, so 1 thread on 2). Off: apply() fills them all on the step's path with `threads`. Where
        # torch's threads take every core, the worker only competes with them (Settings.grammar_fill)
        self.ahead = ahead
        self.eos_ids = list(tokenizer.eos_tokens)
        self.words = (tokenizer.vocab_size + 31) // 32  # int32 words per row of the bitmask
        self._executor = LLExecutor(num_threads=threads)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")
        self._states: dict[Key, _State] = {}
        # grammar text → a compiled, unused matcher, and the grammar's DFA if it is one regex (regex_states.py)
        self._fresh: OrderedDict[str, tuple[LLMatcher, RegexStates | None]] = OrderedDict()
        self._texts: dict[int, str | None] = {}  # token id → its text, for the DFAs
        self._mask_budget = MaskBudget(regex_mask_bytes // (4 * self.words))  # masks all regexes may remember
        self._cache_size = cache_size
        self._ahead: concurrent.futures.Future | None = None  # (masks, {key: (row, version)}) for the next step
        # what the grammar work cost and whether its shortcuts fired: matchers compiled vs copied from the cache,
        # masks filled ahead (off the step's path) vs on it, and wall seconds per phase (fill_ahead runs on the
        # worker, beside the forward pass; the rest is on the step's path)
        self.stats = {
            "steps": 0,
            "rows": 0,
            "compiled": 0,
            "reused": 0,
            "ahead_rows": 0,
            "inline_rows": 0,
            "cached_rows": 0,  # masks copied from a regex state seen before (of the rows above, none walked the trie)
            "sparse_rows": 0,
            "draft_rows": 0,  # picks past a drafted row's first, masked after its drafts (speculative decoding)
        }
        self.seconds = {"open": 0.0, "apply": 0.0, "advance": 0.0, "fill_ahead": 0.0}

    def set_fill(self, ahead: bool, threads: int | None = None) -> None:
        """Where the masks are filled from now on (see `ahead` in __init__); the bench compares the two."""
        self._settle()
        self.ahead, self._executor = ahead, LLExecutor(num_threads=threads)

    @classmethod
    def from_file(cls, tokenizer_json: str, eos_ids: Sequence[int], **kwargs) -> Constraints:
        """From the served tokenizer.json and all of the model's EOS ids (Gemma's 262k vocabulary: seconds)."""
        return cls(LLTokenizer(tokenizer_json, eos_token=[int(i) for i in eos_ids]), **kwargs)

    def __contains__(self, key: Key) -> bool:
        return key in self._states

    def __len__(self) -> int:
        return len(self._states)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    # ---- sequences ---------------------------------------------------------------------------------------
    def _matcher(self, grammar: str) -> tuple[LLMatcher, RegexStates | None]:
        cached = self._fresh.get(grammar)
        if cached is None:
            fresh = LLMatcher(self.tokenizer, grammar, log_level=0)
            self.stats["compiled"] += 1
            if fresh.is_error():
                return fresh, None  # not cached: the error is reported for this sequence
            regex = RegexStates.for_grammar(grammar, self.tokenizer, self._texts, self._mask_budget)
            cached = self._fresh[grammar] = (fresh, regex)
            if len(self._fresh) > self._cache_size:
                _, (_, dropped) = self._fresh.popitem(last=False)
                if dropped is not None:
                    dropped.close()  # its masks go back to the budget
        else:
            self.stats["reused"] += 1
            self._fresh.move_to_end(grammar)
        return cached[0].deep_copy(), cached[1]

    def open(self, key: Key, grammar: str, replay: Sequence[int] = ()) -> str | None:
        """Start constraining `key`; replay the tokens it generated already. Returns the error, if any (it is
        reported again by apply(), where the scheduler learns of it)."""
        t0 = time.perf_counter()
        self._settle()
        matcher, regex = self._matcher(grammar)
        state = _State(grammar, matcher, matcher.get_error() or None, regex)
        self._states[key] = state
        if replay and state.error is None:
            self._consume(state, [int(t) for t in replay])
        self.seconds["open"] += time.perf_counter() - t0
        return state.error

    def rebuild(self, key: Key, tokens: Sequence[int]) -> str | None:
        """Back to the grammar's start, then replay `tokens` (a recompute from the scheduler's token list)."""
        return self.open(key, self._states[key].grammar, tokens)  # a fresh matcher: an error state never clears

    def rollback(self, key: Key, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (a rejected speculative draft); False if llguidance cannot."""
        self._settle()
        state = self._states[key]
        state.version += 1
        ok = state.error is None and state.matcher.rollback(num_tokens)
        if state.regex is not None and num_tokens:
            if ok and num_tokens <= len(state.trail):
                state.at = state.trail[-num_tokens]
                del state.trail[-num_tokens:]
            else:  # the regex state is unknown from here: llguidance alone fills this row's masks
                state.at = None
                state.trail.clear()
        return ok

    def discard(self, key: Key) -> None:
        self._states.pop(key, None)  # a mask being filled ahead holds its own reference to the matcher

    def clear(self) -> None:
        """Forget every sequence (a new scheduler's probe: the shard starts from a clean slate)."""
        self._settle()
        self._states.clear()

    def is_accepting(self, key: Key) -> bool:
        """Whether the output so far is a complete answer (EOS may follow)."""
        self._settle()  # llguidance refuses a matcher that the worker is reading ("Already borrowed")
        return self._states[key].matcher.is_accepting()

    def _consume(self, state: _State, tokens: list[int]) -> None:
        state.version += 1
        matcher = state.matcher
        regex = state.regex
        for token in tokens:
            if regex is not None:
                state.trail.append(state.at)
                state.at = regex.step(state.at, token)
            if matcher.is_stopped() and token in self.eos_ids:
                return  # EOS after a complete answer: the sequence ends here
            if not matcher.consume_token(token):
                state.error = matcher.get_error() or f"token {token} does not fit the grammar"
                return

    # ---- steps -------------------------------------------------------------------------------------------
    def advance(self, keys: Sequence[Key | None], tokens: Sequence[int]) -> list[RowError]:
        """Feed each constrained row's sampled token to its matcher, then start filling the next step's masks."""
        t0 = time.perf_counter()
        self._settle()
        errors, moved = [], []
        for row, (key, token) in enumerate(zip(keys, tokens)):
            state = self._states.get(key) if key is not None else None
            if state is None:
                continue
            if state.error is None:
                self._consume(state, [int(token)])
                if state.error is not None:
                    errors.append(RowError(row, key, state.error))
            moved.append(key)
        moved = list(dict.fromkeys(moved))  # a drafted row moves by each of its accepted tokens
        if moved and self.ahead:  # the states are taken here: the worker never reads the dict, which the caller changes
            self._ahead = self._worker.submit(self._fill_ahead, moved, [self._states[k] for k in moved])
        self.seconds["advance"] += time.perf_counter() - t0
        return errors

    def _settle(self) -> None:
        """Wait for the masks being filled ahead: nothing may move a matcher while llguidance reads it."""
        if self._ahead is not None:
            concurrent.futures.wait([self._ahead])

    def _fill(self, states: list[_State]) -> np.ndarray:
        masks = np.zeros((len(states), self.words), dtype=np.int32)
        jobs, twins = [], []  # twins: (row, the row of the same regex state being filled)
        filling: dict[tuple[int, int], int] = {}
        for i, s in enumerate(states):
            if s.error is not None:
                continue
            if s.regex is None or s.at is None:
                jobs.append((s.matcher, i))
                continue
            seen = s.regex.masks.get(s.at)
            if seen is not None:
                masks[i] = seen
            elif (id(s.regex), s.at) in filling:
                twins.append((i, filling[id(s.regex), s.at]))
            else:
                filling[id(s.regex), s.at] = i
                jobs.append((s.matcher, i))
                continue
            self.stats["cached_rows"] += 1
        if jobs:
            self._executor.unsafe_compute_mask_ptr(jobs, masks.ctypes.data, self.words * 4, len(states))
            for i in filling.values():
                states[i].regex.remember(states[i].at, masks[i])
            for i, j in twins:
                masks[i] = masks[j]
        return masks

    def _fill_ahead(
        self, keys: list[Key], states: list[_State]
    ) -> tuple[np.ndarray, dict[Key, tuple[int, int, _State]]]:
        t0 = time.perf_counter()
        masks = self._fill(states)
        self.seconds["fill_ahead"] += time.perf_counter() - t0
        return masks, {k: (i, s.version, s) for i, (k, s) in enumerate(zip(keys, states))}

    def masks(self, keys: Sequence[Key], drafts: Sequence[Pick | None] | None = None) -> np.ndarray:
        """[len(keys), words] int32 bitmasks (bit t of the row = token t allowed); the ones filled ahead are
        reused when their matcher has not moved since, the rest are filled now. `drafts`, per row: None, or the
        (drafts, j) of pick j of a drafted row, whose picks are consecutive rows: its masks are filled now."""
        states = [self._states[k] for k in keys]
        out = np.zeros((len(keys), self.words), dtype=np.int32)
        ahead, where = (None, {}) if self._ahead is None else self._ahead.result()
        self._ahead = None
        missing, chains = [], []
        for i, (key, state) in enumerate(zip(keys, states)):
            pick = drafts[i] if drafts is not None else None
            if pick is not None:
                if pick[1] == 0 and state.error is None:  # a drafted row's first pick: its chain starts here
                    chains.append((state.matcher, i, list(pick[0])))
                continue
            hit = where.get(key)
            if hit is not None and hit[1] == state.version and hit[2] is state:
                out[i] = ahead[hit[0]]
            else:
                missing.append(i)
        if missing:
            out[missing] = self._fill([states[i] for i in missing])
        if chains:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(chains, out.ctypes.data, self.words * 4, len(keys))
            for _, i, chain in chains:  # past a refused draft nothing was written: those picks are never kept,
                for j in range(i + 1, i + 1 + len(chain)):  # but they are sampled, so they get a mask that allows
                    if not out[j].any():  # what the last one allowed (an empty row would report an error)
                        out[j] = out[j - 1]
            self.stats["draft_rows"] += sum(len(c[2]) for c in chains)
        picks = 0 if drafts is None else sum(d is not None for d in drafts)
        self.stats["ahead_rows"] += len(keys) - len(missing) - picks
        self.stats["inline_rows"] += len(missing)
        return out

    def apply(
        self,
        logits: torch.Tensor,
        keys: Sequence[Key | None],
        sparse_ok: Sequence[int] = (),
        sparse: dict[int, np.ndarray] | None = None,
        drafts: Sequence[Pick | None] | None = None,
    ) -> list[RowError]:
        """Mask `logits` [rows, vocab] in place: each row whose key is constrained keeps only the tokens its
        grammar allows. Rows of None (or an unconstrained key) are untouched. Returns the rows left with nothing
        allowed; each of those gets the first EOS id as its only choice.

        The rows of `sparse_ok` whose grammar allows few tokens (under half the vocabulary) are left unwritten on
        CPU: their allowed ids go into `sparse` instead ({row: ascending int64 ids}), for a caller that chooses
        among those ids alone and never reads the rest of the row. `drafts`: per row, see masks()."""
        rows = [i for i, k in enumerate(keys) if k is not None and k in self._states]
        if not rows:
            return []
        t0 = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["rows"] += len(rows)
        try:
            ok = set(sparse_ok) if sparse is not None else set()
            errors, few = self._apply(logits, keys, rows, ok, None if drafts is None else [drafts[i] for i in rows])
            if few:
                sparse.update(few)
                self.stats["sparse_rows"] += len(few)
            return errors
        finally:
            self.seconds["apply"] += time.perf_counter() - t0

    def _apply(
        self,
        logits: torch.Tensor,
        keys: Sequence[Key | None],
        rows: list[int],
        sparse_ok: set[int],
        drafts: list[Pick | None] | None,
    ) -> tuple[list[RowError], dict[int, np.ndarray]]:
        self._settle()
        bits = self.masks([keys[i] for i in rows], drafts).view(np.uint32)
        errors = []
        for j in np.flatnonzero(~bits.any(axis=1)).tolist():  # checked on the packed words: 32x less to read
            key = keys[rows[j]]
            errors.append(RowError(rows[j], key, self._states[key].error or "no token fits the grammar"))
            eos = self.eos_ids[0]
            bits[j, eos // 32] = np.uint32(1 << (eos % 32))
        if logits.device.type != "cpu":
            blocked = unpack(bits.view(np.int32), logits.shape[-1], logits.device, blocked=True)
            for j, row in enumerate(rows):
                logits[row].masked_fill_(blocked[j], float("-inf"))
            return errors, {}
        return errors, mask_rows(logits, rows, bits, sparse_ok)
