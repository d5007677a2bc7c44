"""A request's parameters, twice: as the client sent them (Parameters, checked by the tokenizer) and as the
shard samples with them (SamplingParams, resolved by the tokenizer). Both travel inside bus messages
(libs.protocol.messages)."""

from __future__ import annotations

from typing import Any

import msgspec


class Parameters(msgspec.Struct, kw_only=True):
    """TGI's generation parameters as the client sent them (None = not given); checked by the tokenizer."""

    max_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = []
    details: bool = False
    return_full_text: bool | None = None
    truncate: int | None = None
    best_of: int | None = None  # http fans a request with best_of > 1 out into that many requests
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    typical_p: float | None = None
    watermark: bool = False
    decoder_input_details: bool = False  # prefill tokens with their logprobs in `details`
    top_n_tokens: int | None = None
    # TGI's GrammarType, a bare GBNF string, or an OpenAI response_format, as sent; the tokenizer compiles it
    grammar: Any = None
    adapter_id: str | None = None


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True):
    """What the shard needs to pick a token, resolved from Parameters by the tokenizer."""

    do_sample: bool = False  # False = greedy (argmax)
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0  # seeds the request's own generator when sampling
    repetition_penalty: float = 1.0  # 1.0 = off; HF style over prompt + generated ids
    frequency_penalty: float = 0.0  # 0.0 = off; minus penalty * count / length
    typical_p: float = 1.0  # 1.0 = off
    watermark: bool = False  # Kirchenbauer et al. green-list bias (gamma/delta from the shard's settings)
    top_n_tokens: int = 0  # alternatives to report per generated token (after the warpers)
    prompt_logprobs: bool = False  # report the logprob of every prompt token (decoder_input_details)

    def keeps_history(self) -> bool:
        """Whether the shard keeps the sequence's token ids (a penalty or the watermark reads them); the scheduler
        then sends the ids a sequence starts past (NewSequence.prefix_ids)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.watermark

    def warps(self) -> bool:
        """Whether any warper (temperature, top-k, top-p, typical-p) changes the row's scores."""
        return self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0

    def samples(self) -> bool:
        """Whether the row draws its token rather than taking the argmax (TGI: do_sample, or any warper)."""
        return self.do_sample or self.warps()
