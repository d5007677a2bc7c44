"""services.tokenizer.grammar: a grammar text that compiled once is not compiled again (many requests share one
schema or one tool list), and a text that failed is compiled, and refused, every time; a long compile hands back
to the service (its heartbeat) while it waits."""

from __future__ import annotations

import time

import pytest

from services.tokenizer.grammar import GrammarCompiler
from services.tokenizer.validation import ValidationError
from tests.tiny_models import EOS

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_a_text_that_compiled_is_reused_and_a_bad_one_is_not(tiny_dir):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS], cache_size=2)
    try:
        first = c.check({"type": "json", "value": SCHEMA})
        again = c.check({"type": "json", "value": SCHEMA})
        assert again.grammar.text == first.grammar.text and (c.compiled, c.reused) == (1, 1)
        for _ in range(2):
            with pytest.raises(ValidationError, match="grammar is not valid"):
                c.check({"type": "gbnf", "value": "root ::= nope"})
        assert (c.compiled, c.reused) == (1, 1)  # errors are never remembered as valid
        c.check({"type": "regex", "value": "a+"})
        c.check({"type": "regex", "value": "b+"})  # the oldest text (the schema) leaves the cache of 2
        c.check({"type": "json", "value": SCHEMA})
        assert (c.compiled, c.reused) == (4, 1)
    finally:
        c.close()


def test_a_long_compile_lets_the_service_beat(tiny_dir, monkeypatch):
    c = GrammarCompiler(str(tiny_dir / "tokenizer.json"), [EOS])
    beats = []
    c.on_wait = lambda: beats.append(1)
    try:
        compile_for_real = c._compile

        def slow(text: str) -> str:  # a compile that takes a second (some schemas take minutes)
            time.sleep(1.0)
            return compile_for_real(text)

        monkeypatch.setattr(c, "_compile", slow)
        assert c.check({"type": "regex", "value": "a+"}).kind == "regex"
        assert len(beats) >= 1  # waits of 0.25 s: the service beat while llguidance worked
    finally:
        c.close()
