"""Incremental, UTF-8-safe detokenization of one request's generated tokens (TGI's decode_token).

TGI keeps two offsets into the ids: `prefix_offset` (start of the left context, text already emitted) and
`read_offset` (end of what has been emitted). Each token decodes ids[prefix:read] and ids[prefix:]; the
extra text of the second is the token's text, unless it ends in U+FFFD (an incomplete UTF-8 character,
whose bytes are held back until a later token completes it).

A model whose chat format is written in special tokens (gpt-oss's harmony: `keep_special`) keeps them in its whole
text too; for any other model that text skips them, as TGI's generated_text does.
"""

from __future__ import annotations

import functools

import tokenizers

from libs.protocol.messages import PROMPT_TAIL

REPLACEMENT = "\ufffd"
# A UTF-8 character needs at most 4 bytes, so at most 4 byte tokens; once more than MAX_PENDING tokens are
# held back they can never complete and we give up on them (see IncrementalDecoder.push).
MAX_PENDING = 8


@functools.lru_cache(maxsize=16)
def special_ids(tokenizer: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (those skip_special_tokens=True drops), computed once."""
    return frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _delta(context: str, text: str) -> str:
    """The part of `text` that `context` does not cover.

    TGI slices at len(context). That is right whenever `text` extends `context`; it is not when the context
    ends in an incomplete character that a new byte completes (possible only after we gave up on garbage
    bytes), where the context's trailing U+FFFD turns into a real character: then cut at the common prefix.
    """
    if text.startswith(context):
        return text[len(context) :]
    return text[_common_prefix(context, text) :]


class IncrementalDecoder:
    """Turns one request's generated token ids into text, one token at a time.

    `push(token_id)` returns the text this token adds ("" while bytes are held back) and never returns
    U+FFFD. The decoded window (`window` tokens: the left context plus the pending tokens) stays bounded.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_tail: list[int], keep_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.keep_special = keep_special
        self._special = special_ids(tokenizer)
        self._context = list(prompt_tail[-PROMPT_TAIL:])  # prompt ids before the first generated one (PROMPT_TAIL: why)
        self._ids = list(self._context)  # context + every generated id; final_text needs them all
        self._prefix = 0  # absolute indexes into self._ids
        self._read = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix:read], cached between pushes

    @property
    def window(self) -> int:
        """Number of ids the next push decodes (left context + held-back tokens + 1)."""
        return len(self._ids) - self._prefix + 1

    @property
    def generated(self) -> list[int]:
        return self._ids[len(self._context) :]

    def special(self, token_id: int) -> bool:
        return token_id in self._special

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Append one generated token and return its incremental text (skip_special_tokens=False, as TGI)."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        delta = _delta(self._prefix_text, text)
        if delta and not text.endswith(REPLACEMENT):
            return self._advance(delta)
        if len(self._ids) - self._read > MAX_PENDING:
            # More held-back tokens than any UTF-8 character needs: these bytes are invalid and will stay
            # so. Give up on them: emit what decoded, minus the U+FFFD, and move the window on, so the
            # window (and the cost of each push) stays bounded over any run of garbage tokens.
            return self._advance(delta)
        return ""

    def _advance(self, delta: str) -> str:
        # The ids just emitted become the next left context (TGI: prefix_offset = read_offset).
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None  # the new context is another slice: decoded on the next push
        # Never emit U+FFFD: it stands for invalid bytes (held back, or mid-text). A real U+FFFD the model
        # wrote (bytes EF BF BD) is dropped too: rare, and not told apart from the decoder's own.
        return delta.replace(REPLACEMENT, "")

    def flush(self) -> str:
        """Text still held back at the end of the request (an incomplete last character), U+FFFD removed."""
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        return self._advance(_delta(self._prefix_text, text))

    def final_text(self) -> str:
        """TGI's generated_text: the generated ids decoded with one token of left context, special tokens
        skipped (kept with `keep_special`), a stop sequence kept. Unlike TGI (which returns "" when the text ends
        in an incomplete character) it is the whole decode with U+FFFD removed, so it matches the streamed text."""
        n_ctx = min(len(self._context), 1)
        ids = self._ids[len(self._context) - n_ctx :]
        skip = not self.keep_special
        text = self._decode(ids, skip_special_tokens=skip)
        context = self._decode(ids[:n_ctx], skip_special_tokens=skip)
        return _delta(context, text).replace(REPLACEMENT, "")
