"""Token masks of a regex grammar, remembered by the state the regex is in.

A one-regex grammar (TGI's `{"type":"regex"}`) allows, after any output, exactly the tokens whose bytes start some
string that completes the match (and EOS where the output already matches): that set depends only on the state of
the regex's DFA, so outputs in one state share one mask, and a state seen before is a copy, not a walk of the whole
token trie. llguidance still computes every mask it is asked for and moves every matcher; only the fill of a state
seen before is skipped. The DFA is `interegular`'s, which reads Python's regex syntax where llguidance reads Rust's,
so the cache serves only regexes both read alike (`shared_syntax`); a row whose output ends inside a UTF-8
character, or holds a special token, leaves it for the rest of its sequence. The masks of all regexes share one
budget per shard (`MaskBudget`); a regex leaving the shard's grammar cache gives its masks back. Why:
docs/structured-output.md; test_regex_states.py checks the cached masks against llguidance.
"""

from __future__ import annotations

import json
import re
import string

import interegular
import numpy as np
from llguidance import LLMatcher, LLTokenizer

_LARK = re.compile(r"start: /(.*)/", re.S)
_COUNT = re.compile(r"\{(\d+)(,(\d+)?)?\}")  # {m}, {m,}, {m,n}: read alike ({,n} is not)
# escaped ASCII punctuation is a literal in both syntaxes (Rust refuses \< and \>: word boundaries there)
_ESCAPABLE = set(string.punctuation + " ") - set("<>")


def regex_of(grammar: str) -> str | None:
    """The regex of a grammar text that is one regex exactly as llguidance writes it (grammar_from_regex), and
    only one in the syntax both engines read alike; else None."""
    try:
        spec = json.loads(grammar)
        (only,) = spec["grammars"]
        match = _LARK.fullmatch(only.get("lark_grammar") or "")
    except (ValueError, KeyError, TypeError):
        return None
    if match is None or spec.get("max_tokens") is not None:
        return None
    rx = match.group(1).replace("\\/", "/")
    if not shared_syntax(rx):
        return None
    try:
        if LLMatcher.grammar_from_regex(rx) != grammar:
            return None
    except Exception:
        return None
    return rx


def shared_syntax(rx: str) -> bool:
    """Whether `rx` uses only syntax that Python's (interegular's) and Rust's (llguidance's) regexes read alike."""
    i, n, prev_quant = 0, len(rx), False
    while i < n:
        c = rx[i]
        quant = False
        if c == "\\":
            if i + 1 >= n or not _escape_ok(rx[i + 1]):
                return False
            i += 2
        elif c == "[":
            end = _class_end(rx, i)
            if end < 0:
                return False
            i = end + 1
        elif c == "(":
            if rx.startswith("(?", i):
                return False  # flags, non-capturing and named groups, lookarounds: not worth telling apart
            i += 1
        elif c in "*+?":
            if prev_quant and c != "?":
                return False  # possessive (Python) or a repeated quantifier
            quant, i = c != "?" or not prev_quant, i + 1
        elif c == "{":
            m = _COUNT.match(rx, i)
            if m is None or prev_quant:
                return False
            quant, i = True, m.end()
        elif c in "^$}":
            return False  # anchors; a bare brace
        else:
            i += 1
        prev_quant = quant
    return True


def _escape_ok(c: str) -> bool:
    return c in _ESCAPABLE or c in "ntr"


def _class_end(rx: str, start: int) -> int:
    """The index of the `]` closing the class at `start`, or -1 for a class outside the shared syntax."""
    i = start + 1
    if rx.startswith("^", i):
        i += 1
    if rx.startswith("]", i):
        i += 1  # a leading ] is a literal in both
    while i < len(rx):
        c = rx[i]
        if c == "]":
            return i
        if c == "[" or rx.startswith(("&&", "--", "~~"), i):
            return -1  # nested classes and set operations (Rust) are literals in Python
        if c == "\\":
            if i + 1 >= len(rx) or not _escape_ok(rx[i + 1]):
                return -1
            i += 2
        else:
            i += 1
    return -1


class MaskBudget:
    """How many more masks the regexes of one shard may remember, all together (a mask of Gemma's 262k vocabulary
    is 32 KiB: a regex of thousands of states, or many regexes, must not grow the shard without bound)."""

    def __init__(self, masks: int) -> None:
        self.left = masks


class RegexStates:
    """One regex's DFA over the served vocabulary's tokens, and the masks seen per state (shared by every
    sequence of that grammar). A state is an int; None means "not tracked" (never cached)."""

    def __init__(self, rx: str, tokenizer: LLTokenizer, texts: dict[int, str | None], budget: MaskBudget) -> None:
        fsm = interegular.parse_pattern(rx).to_fsm()
        self.initial: int | None = fsm.initial
        self._map, self._alphabet = fsm.map, fsm.alphabet
        self._tokenizer, self._texts = tokenizer, texts  # token id → its text (None: not whole characters)
        self.masks: dict[int, np.ndarray] = {}
        self._budget, self._closed = budget, False

    @classmethod
    def for_grammar(cls, grammar: str, tokenizer: LLTokenizer, texts: dict, budget: MaskBudget) -> RegexStates | None:
        rx = regex_of(grammar)
        if rx is None:
            return None
        try:
            return cls(rx, tokenizer, texts, budget)
        except Exception:  # interegular refuses a construct it does not model
            return None

    def close(self) -> None:
        """Forget the masks and remember no more (the grammar left the shard's cache; sequences still running on
        it get their masks from llguidance alone)."""
        self._closed = True
        self._budget.left += len(self.masks)
        self.masks.clear()

    def _text(self, token: int) -> str | None:
        if token not in self._texts:
            text = None
            if not self._tokenizer.is_special_token(token):
                try:
                    text = self._tokenizer.decode_bytes([token]).decode("utf-8")
                except UnicodeDecodeError:
                    pass
            self._texts[token] = text
        return self._texts[token]

    def step(self, state: int | None, token: int) -> int | None:
        """The state after `token`, or None (the token leaves the regex, or is not whole characters)."""
        text = None if state is None else self._text(token)
        if text is None:
            return None
        for ch in text:
            state = self._map[state].get(self._alphabet[ch])
            if state is None:
                return None
        return state

    def remember(self, state: int | None, mask: np.ndarray) -> None:
        if state is None or self._closed or self._budget.left <= 0 or not mask.any():  # empty: a matcher's error
            return
        if state not in self.masks:
            self._budget.left -= 1
        self.masks[state] = mask.copy()
