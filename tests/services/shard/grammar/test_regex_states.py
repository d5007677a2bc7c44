"""services.shard.grammar.regex_states: which regexes may have their masks remembered, and that every remembered mask is
the one llguidance computes for that output (random walks on the tiny byte-level tokenizer, whose tokens include
partial UTF-8 characters and newlines)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from llguidance import LLMatcher

from services.shard.grammar.matchers import Constraints
from services.shard.grammar.regex_states import regex_of, shared_syntax
from services.tokenizer.grammar import grammar_text
from tests.tiny_models import EOS, build_tokenizer

SHARED = [
    r"[A-Z][a-z]{2,10}( [a-z]{2,10}){8,16}\.",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(yes|no|maybe)( and (yes|no)){0,3}",
    r"[^\"]{0,12}\"",
    r".{2,6}x",
    r"[a-c]+?(,[a-c]+)*",
    r"a/b\/c[]x-]",
    r"(\(|\[)[^\]\n]*\]",
]
NOT_SHARED = [
    r"\d{3}",  # Unicode digits in Rust, ASCII in interegular
    r"\w+",
    r"\p{L}+",
    r"[a-z&&[^aeiou]]+",  # a set operation in Rust, literals in Python
    r"[[:alpha:]]",
    r"^abc$",
    r"(?i)abc",
    r"(?:ab)+",
    r"a{,3}",
    r"a*+",
    r"a{2}{3}",
    r"\x41",
    r"\bword",
    r"[a-z}]+}",
]


@pytest.mark.parametrize("rx", SHARED)
def test_shared_regexes_are_recognised_in_llguidance_grammars(rx):
    assert shared_syntax(rx)
    grammar = LLMatcher.grammar_from_regex(rx)
    assert regex_of(grammar) == rx.replace("\\/", "/")  # llguidance writes / and \/ alike


@pytest.mark.parametrize("rx", NOT_SHARED)
def test_regexes_read_differently_are_not(rx):
    assert not shared_syntax(rx)


def test_other_grammars_are_not_regexes():
    assert regex_of(grammar_text({"type": "json", "value": {"type": "object"}})[1]) is None
    assert regex_of(grammar_text({"type": "lark", "value": 'start: /ab+/ "c"'})[1]) is None
    assert regex_of(grammar_text({"type": "lark", "value": "start: /ab+/i"})[1]) is None
    assert regex_of("not json") is None


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("regex-tok")
    build_tokenizer(folder)
    return str(folder / "tokenizer.json")


def reference_mask(cons: Constraints, grammar: str, tokens: list[int]) -> np.ndarray:
    m = LLMatcher(cons.tokenizer, grammar, log_level=0)
    for t in tokens:
        assert m.consume_token(t)
    return np.frombuffer(m.compute_bitmask(), dtype=np.int32)[: cons.words]


@pytest.mark.parametrize("rx", SHARED)
def test_remembered_masks_equal_llguidance_masks(tok_path, rx):
    cons = Constraints.from_file(tok_path, [EOS], ahead=False)
    grammar = LLMatcher.grammar_from_regex(rx)
    rng = np.random.default_rng(0)
    keys = list(range(12))
    for k in keys:
        cons.open(k, grammar)
    tokens = {k: [] for k in keys}
    checked = ended = 0
    while any(k in cons for k in keys):
        live = [k for k in keys if k in cons]
        masks = cons.masks(live).view(np.uint32)
        picks = []
        for k, mask in zip(live, masks):
            want = reference_mask(cons, grammar, tokens[k]).view(np.uint32)
            assert np.array_equal(mask, want), f"row {k} after {tokens[k]}"
            checked += 1
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            # walk off the likeliest path: long tokens and rare ones both get picked
            picks.append(int(rng.choice(allowed)))
        cons.advance(live, picks)
        for k, t in zip(live, picks):
            tokens[k].append(t)
            if t == EOS or len(tokens[k]) >= 60:  # an unbounded regex: the walk stops there
                cons.discard(k)
    for k in keys:
        text = cons.tokenizer.decode_str([t for t in tokens[k] if t != EOS])
        if tokens[k][-1] == EOS:
            assert re.fullmatch(rx, text), text
            ended += 1
    assert ended >= 1
    # the cache fired: for the bounded counts' many repeated states, on most rows
    assert cons.stats["cached_rows"] > (checked // 2 if "{8,16}" in rx else 0), (cons.stats, checked)
    cons.close()


def test_rollback_restores_the_regex_state(tok_path):
    cons = Constraints.from_file(tok_path, [EOS], ahead=False)
    grammar = LLMatcher.grammar_from_regex(r"[a-c]{1,8}(,[a-c]{1,8}){0,4}")
    cons.open("k", grammar)
    state = cons._states["k"]
    start = state.at
    tokens = [cons.tokenizer.tokenize_str(s)[0] for s in ("a", ",", "b")]
    cons.advance(["k"], [tokens[0]])
    after_a = state.at
    cons.advance(["k"], [tokens[1]])
    cons.advance(["k"], [tokens[2]])
    assert start is not None and after_a not in (None, start)
    assert cons.rollback("k", 2)
    assert state.at == after_a and len(state.trail) == 1
    want = reference_mask(cons, grammar, tokens[:1]).view(np.uint32)
    assert np.array_equal(cons.masks(["k"]).view(np.uint32)[0], want)
    cons.close()


def test_the_shard_remembers_masks_within_its_budget(tok_path):
    probe = Constraints.from_file(tok_path, [EOS], ahead=False)
    words = probe.words
    probe.close()
    cons = Constraints.from_file(tok_path, [EOS], ahead=False, cache_size=2, regex_mask_bytes=5 * 4 * words)
    first = LLMatcher.grammar_from_regex(r"[a-c]{1,8}(,[a-c]{1,8}){0,4}")
    cons.open("a", first)
    regex = cons._states["a"].regex
    rng = np.random.default_rng(1)
    tokens = []
    for _ in range(12):  # more states than the budget's five masks
        mask = cons.masks(["a"]).view(np.uint32)[0]
        assert np.array_equal(mask, reference_mask(cons, first, tokens).view(np.uint32))
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        allowed = allowed[allowed != EOS]
        if not len(allowed):
            break
        tokens.append(int(rng.choice(allowed)))
        cons.advance(["a"], tokens[-1:])
    assert len(regex.masks) == 5 and cons._mask_budget.left == 0
    # two other regexes push the first out of the shard's cache: its masks go back to the budget
    cons.open("b", LLMatcher.grammar_from_regex(r"(yes|no)!"))
    cons.open("c", LLMatcher.grammar_from_regex(r"[0-9]{2}"))
    assert regex.masks == {} and cons._mask_budget.left == 5
    cons.masks(["a"])  # still served, by llguidance alone, and no longer remembered
    assert regex.masks == {}
    cons.close()
