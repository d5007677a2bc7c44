"""Token texts for TGI's `details`: the top-n alternatives of a generated token and the prefill tokens.

Each token is decoded alone, special tokens kept and no cleanup, as TGI's
`batch_decode(ids, clean_up_tokenization_spaces=False, skip_special_tokens=False)` one token at a time
(as TGI's decode_token). A lone token may be part of a UTF-8 character; its text then holds U+FFFD, as in TGI.
"""

from __future__ import annotations

import math

from tokenizers import Tokenizer

from libs.protocol.messages import StreamOpen, TokenText
from services.detokenizer.incremental import special_ids

CACHE_LIMIT = 1 << 18  # token texts kept; bounded so a huge vocabulary cannot grow it without end


class TokenTexts:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.special = special_ids(tokenizer)
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        # tokenizers' decode does no cleanup of spaces (that is a transformers option), so this is TGI's text
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < CACHE_LIMIT:
                self._texts[token_id] = text
        return text

    def token(self, token_id: int, logprob: float | None) -> TokenText:
        if logprob is not None and math.isnan(logprob):
            logprob = None  # TGI: NaN (the first prompt token) serializes as null
        return TokenText(id=token_id, text=self.text(token_id), logprob=logprob, special=token_id in self.special)

    def alternatives(self, ids: list[int], logprobs: list[float]) -> list[TokenText]:
        return [self.token(i, lp) for i, lp in zip(ids, logprobs)]

    def prefill(self, o: StreamOpen) -> list[TokenText]:
        """TGI's `prefill` for a request that asked for decoder_input_details; [] when it did not."""
        logprobs = o.prompt_logprobs
        return [self.token(i, logprobs[k] if k < len(logprobs) else None) for k, i in enumerate(o.prompt_ids)]

    def prefill_greedy(self, o: StreamOpen) -> list[TokenText | None]:
        """Per prompt token, the greedy token at its position (None where there is none); [] without them."""
        return [None if i < 0 else self.token(i, lp) for i, lp in zip(o.prompt_greedy_ids, o.prompt_greedy_logprobs)]
