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
    # OpenAI's / vLLM's, from the OpenAI routes only (TGI's /generate has none of them)
    min_p: float | None = None
    logit_bias: dict[int, float] | None = None  # token id → bias added to its logit (-100…100)
    ignore_eos: bool = False  # EOS is an ordinary token: the request runs to max_new_tokens
    min_tokens: int | None = None  # no EOS (nor stop_token_ids) before this many tokens
    stop_token_ids: list[int] = []  # any of them ends the request (finish: eos_token, OpenAI's `stop`)
    # vLLM's (on the OpenAI routes; on TGI's /generate an extension): lower runs first under
    # --scheduling-policy priority; anything but 0 is refused under fcfs, as vLLM does
    priority: int = 0


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
    min_p: float = 0.0  # 0.0 = off; MinPLogitsWarper, between top-p and typical-p
    logit_bias: dict[int, float] = {}  # token id → bias, added before the penalties
    # min_tokens as a sequence length: below it the `min_length_ids` (EOS, stop_token_ids) are masked
    min_length: int = 0
    min_length_ids: list[int] = []
    ignore_eos: bool = False  # the scheduler does not stop at EOS
    stop_token_ids: list[int] = []  # the scheduler stops at any of them
    min_tokens: int = 0  # the scheduler stops at EOS / stop_token_ids only from this many tokens on
    priority: int = 0  # the scheduler's order under --scheduling-policy priority: lower first (docs/scheduling.md)

    def keeps_history(self) -> bool:
        """Whether the shard keeps the sequence's token ids (a penalty or the watermark reads them); the scheduler
        then sends the ids a sequence starts past (NewSequence.prefix_ids)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.watermark

    def biases(self) -> bool:
        """Whether a processor that needs no history (logit_bias, the min_tokens mask) may change the scores."""
        return bool(self.logit_bias) or (self.min_length > 0 and bool(self.min_length_ids))

    def warps(self) -> bool:
        """Whether any warper (temperature, top-k, top-p, min-p, typical-p) changes the row's scores."""
        return self.temperature != 1.0 or self.truncates()

    def truncates(self) -> bool:
        """Whether a warper other than temperature removes tokens (top-k, top-p, min-p, typical-p)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or self.typical_p < 1.0

    def samples(self) -> bool:
        """Whether the row draws its token rather than taking the argmax (TGI: do_sample, or any warper)."""
        return self.do_sample or self.warps()
