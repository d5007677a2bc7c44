"""Prompts of an exact token count, distinct from each other (no shared prefix for a prefix cache to reuse)."""

from __future__ import annotations

import random
from pathlib import Path

from bench.models import TOKENIZERS, VOCAB, corpus
from bench.serving.loadgen import Job

_TEXT: str | None = None


def _text() -> str:
    global _TEXT
    if _TEXT is None:
        parts, size = [], 0
        for chunk in corpus(*TOKENIZERS[VOCAB]):
            parts.append(chunk)
            size += len(chunk)
            if size > 2_000_000:
                break
        _TEXT = "".join(parts)
    return _TEXT


class Prompts:
    """Cuts prompts out of a fixed text, so that `tokenizer` (the served model's) reads exactly n tokens."""

    def __init__(self, model_dir: str | Path, seed: int = 0):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.specials = len(self.tok.encode("", add_special_tokens=True).ids)  # e.g. the BOS
        self.rng = random.Random(seed)

    def make(self, n: int) -> tuple[str, int]:
        """(a prompt of about n tokens, its exact token count), starting at a random place of the text."""
        text = _text()
        start = self.rng.randrange(0, len(text) - 40 * n - 1)
        ids = self.tok.encode(text[start : start + 40 * n + 400], add_special_tokens=False).ids[1:]
        want = max(1, n - self.specials)
        prompt, got = "", 0
        for _ in range(6):  # decode → re-encode can merge differently at the cut: nudge until it is exact
            prompt = self.tok.decode(ids[:want])
            got = len(self.tok.encode(prompt, add_special_tokens=True).ids)
            if got == n:
                break
            want += n - got
        return prompt, got

    def fixed(self, count: int, prompt_tokens: int, output_tokens: int) -> list[Job]:
        return [Job(*self.make(prompt_tokens), output_tokens) for _ in range(count)]

    def mixed(self, count: int, prompt_tokens: int, output_tokens: int) -> list[Job]:
        """Lengths drawn uniformly from [P/4, 2P] and [O/4, 2O] (seeded, so every engine gets the same set)."""
        jobs = []
        for _ in range(count):
            p = self.rng.randint(max(2, prompt_tokens // 4), 2 * prompt_tokens)
            o = self.rng.randint(max(1, output_tokens // 4), 2 * output_tokens)
            jobs.append(Job(*self.make(p), o))
        return jobs
