"""TGI's request validation (router/src/validation.rs), as pure functions.

Two stages, because the length rules need the token ids:
- `check_parameters` runs the checks that need no tokens, before tokenizing;
- `resolve` truncates the ids, runs the length checks and resolves max_new_tokens and sampling.
Each check raises `ValidationError` with TGI's exact message, in TGI's order, so a request
that breaks two rules gets the same message TGI would give.
"""

from __future__ import annotations

import secrets
from typing import NamedTuple

import numpy as np

from libs.protocol.params import Parameters, SamplingParams

PREFIX = "Input validation error: "
# TGI's DEFAULT_GENERATION_LENGTH: the chunk size its length check uses (validation.rs).
DEFAULT_GENERATION_LENGTH = 1024


class ValidationError(Exception):
    """A request TGI would answer with 422; `message` is TGI's text without the "Input validation error: " prefix."""

    error_type = "validation"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def full_message(self) -> str:
        """TGI's `error` field: `Input validation error: <message>`."""
        return PREFIX + self.message


def _f32(x: float) -> float:
    # TGI parses these floats as f32, so e.g. top_p=0.99999999 rounds to 1.0 and is rejected; do the same.
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _best_of(p: Parameters) -> int:
    return p.best_of if p.best_of is not None else 1


def check_parameters(
    p: Parameters,
    inputs: str,
    *,
    max_stop_sequences: int,
    max_input_tokens: int,
    max_best_of: int = 2,
    max_top_n_tokens: int = 5,
    stream: bool = False,
) -> None:
    """TGI's checks that need no tokens, in TGI's order; raises ValidationError on the first failure.

    Order: the stream route's own refusals (server.rs, before anything), validate_best_of
    (generate_best_of, before validate()), then validate() up to `truncate`. http fans best_of=N out into N
    requests that each keep best_of=N: each copy is checked here as one request, exactly as TGI checks each of
    its N generate() calls.
    """
    best_of = _best_of(p)
    if stream:
        # generate_stream_internal refuses these before taking a permit or validating anything
        if best_of != 1:  # 0 too: TGI compares with != 1 here
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
        if p.decoder_input_details:
            raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    if best_of > 1 or best_of < 0:  # a negative one is a 422 deserialize error in TGI (usize); same message here
        if max_best_of == 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if best_of > max_best_of or best_of < 0:
            raise ValidationError(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
    # TGI's router rule for best_of: a warper that is merely *set* counts as sampling (unlike the shard's rule)
    sampling_set = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if best_of > 1 and not sampling_set:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if p.temperature is not None and _f32(p.temperature) <= 0.0:
        raise ValidationError("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and _f32(p.repetition_penalty) <= 0.0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= _f32(p.frequency_penalty) <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None:
        top_p = _f32(p.top_p)
        if top_p <= 0.0 or top_p >= 1.0:  # written as TGI writes it (a NaN passes there too)
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None:
        typical_p = _f32(p.typical_p)
        if typical_p <= 0.0 or typical_p >= 1.0:
            raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    # TGI's u32 makes 0 the only bad value; a negative one (a 422 deserialize error there) gets the same message here.
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {max_stop_sequences} stop sequences. Given: {len(p.stop)}")
    if p.seed is not None and best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    # u32 in TGI: a negative value is a deserialize error there; here it gets the range message
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {max_top_n_tokens}. Given: {p.top_n_tokens}")
    if inputs == "":  # TGI tests the string, so whitespace-only inputs pass
        raise ValidationError("`inputs` cannot be empty")
    if p.truncate is not None and (p.truncate <= 0 or p.truncate > max_input_tokens):
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {max_input_tokens}. Given: {p.truncate}"
        )


def check_openai_parameters(p: Parameters, *, vocab_size: int) -> None:
    """The OpenAI / vLLM parameters TGI lacks (min_p, logit_bias, min_tokens, stop_token_ids), after TGI's checks;
    the messages are vLLM's (SamplingParams._verify_args, the processor's logit_bias check), logit_bias's range
    OpenAI's. Token ids must be >= 0 and < `vocab_size` (the ids the model can produce)."""
    if p.min_p is not None and not 0.0 <= _f32(p.min_p) <= 1.0:
        raise ValidationError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.min_tokens is not None:
        if p.min_tokens < 0:
            raise ValidationError(f"min_tokens must be greater than or equal to 0, got {p.min_tokens}.")
        if p.max_new_tokens is not None and p.min_tokens > p.max_new_tokens:
            raise ValidationError(
                f"min_tokens must be less than or equal to max_tokens={p.max_new_tokens}, got {p.min_tokens}."
            )
    for token, bias in (p.logit_bias or {}).items():
        if not -100.0 <= bias <= 100.0:
            raise ValidationError(f"logit_bias values must be in [-100, 100], got {bias} for token_id {token}.")
    for name, ids in (("logit_bias", list(p.logit_bias or {})), ("stop_token_ids", p.stop_token_ids)):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValidationError(
                f"token_id(s) {bad} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab_size}"
            )


def check_priority(p: Parameters, policy: str) -> None:
    """A priority other than 0 only where the scheduler orders by it (--scheduling-policy priority); vLLM's text."""
    if p.priority != 0 and policy != "priority":
        raise ValidationError(f"Got priority {p.priority} but Priority scheduling is not enabled.")


def check_adapter(adapter_id: str | None, loaded: list[str], model_id: str) -> str | None:
    """The LoRA adapter a request runs with (None: the base model, also when it names the base model itself).

    Departure from TGI, whose shard serves an unknown adapter_id silently with the base model: here it is an
    error, as an answer from the wrong weights is worse than none."""
    if adapter_id in (None, "", model_id):
        return None
    if adapter_id not in loaded:
        names = ", ".join(f"`{name}`" for name in loaded) or "none"
        raise ValidationError(f"`adapter_id` `{adapter_id}` is not a loaded LoRA adapter (loaded: {names})")
    return adapter_id


class Resolved(NamedTuple):
    input_ids: list[int]  # the prompt after truncation
    max_new_tokens: int  # never None
    sampling: SamplingParams
    seed: int | None  # the seed to report in details: None when greedy


def is_sampling(p: Parameters) -> bool:
    """Whether the shard samples, as TGI's HeterogeneousNextTokenChooser decides.

    A warper makes a request sample only when it changes something: temperature != 1.0, top_k != 0,
    top_p < 1.0, typical_p < 1.0. So `temperature=1.0` alone stays greedy, as in TGI (its router's looser
    "is set" rule is only used for the best_of check, in check_parameters).
    """
    return (
        p.do_sample
        or (p.temperature is not None and _f32(p.temperature) != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and _f32(p.top_p) < 1.0)
        or (p.typical_p is not None and _f32(p.typical_p) < 1.0)
    )


def resolve(
    p: Parameters,
    input_ids: list[int],
    *,
    max_input_tokens: int,
    max_total_tokens: int,
    eos_ids: list[int] = (),
) -> Resolved:
    """Truncate, run TGI's length checks, resolve max_new_tokens and sampling (after check_parameters).

    max_new_tokens: None → max_total_tokens − input_length. TGI generates that in chunks of ≤1024 tokens
    (auto-continuation); Switchyard generates the whole budget in one go. The ≤1024 chunk is
    still what the MaxTotalTokens check uses, as in TGI, so the same requests pass and fail. An explicit
    max_new_tokens > 1024 can pass that check with input_length + max_new_tokens > max_total_tokens; TGI's
    continuation would then fail mid-way, we cap the request at max_total_tokens (it ends with `length`).
    """
    # Left truncation: keep the LAST `truncate` ids (TGI's truncation_side="left").
    input_length = min(len(input_ids), p.truncate) if p.truncate is not None else len(input_ids)
    ids = list(input_ids[len(input_ids) - input_length :])

    if p.max_new_tokens is None:
        max_new_tokens = max(max_total_tokens - input_length, 0)  # Rust's saturating_sub
    else:
        max_new_tokens = p.max_new_tokens
    chunk = min(max_new_tokens, DEFAULT_GENERATION_LENGTH)

    if input_length + chunk > max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {chunk} `max_new_tokens`"
        )
    if input_length > max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {max_input_tokens} tokens. Given: {input_length}")
    # the grammar is TGI's last check: the processor compiles it after this (services.tokenizer.grammar)
    if max_new_tokens < 1:
        # Only reachable when max_input_tokens >= max_total_tokens (TGI's launcher forbids that): the prompt
        # fills the whole budget. TGI would still generate; we cannot, so report it as the budget error.
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and 1 `max_new_tokens`"
        )

    max_new_tokens = min(max_new_tokens, max_total_tokens - input_length)
    # Processors (penalties, watermark) and the reports (top-n, prompt logprobs) apply to greedy rows too.
    common = dict(
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty if p.frequency_penalty is not None else 0.0,
        watermark=p.watermark,
        top_n_tokens=p.top_n_tokens or 0,
        prompt_logprobs=p.decoder_input_details,
        **openai_sampling(p, input_length, eos_ids),
    )
    if not is_sampling(p):
        return Resolved(ids, max_new_tokens, SamplingParams(do_sample=False, **common), None)
    # TGI draws a random u64 seed when none is given, and reports it only for sampled requests. Each copy of a
    # best_of fan-out (seed must be null there) so gets its own seed.
    seed = p.seed if p.seed is not None else secrets.randbits(64)
    sampling = SamplingParams(
        do_sample=True,
        temperature=p.temperature if p.temperature is not None else 1.0,
        top_k=p.top_k if p.top_k is not None else 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        typical_p=p.typical_p if p.typical_p is not None else 1.0,
        min_p=p.min_p if p.min_p is not None else 0.0,  # a warper: greedy rows (temperature 0) ignore it
        seed=seed,
        **common,
    )
    return Resolved(ids, max_new_tokens, sampling, seed)


def openai_sampling(p: Parameters, input_length: int, eos_ids: list[int]) -> dict:
    """The OpenAI / vLLM parameters as SamplingParams fields (greedy rows too): logit_bias, ignore_eos,
    stop_token_ids, and min_tokens both as the scheduler's count and as the shard's mask (the ids that would end
    the sequence — EOS unless ignored, and stop_token_ids — are masked while it is shorter than min_length)."""
    min_tokens = p.min_tokens or 0
    ends = set(p.stop_token_ids) if p.ignore_eos else {int(i) for i in eos_ids} | set(p.stop_token_ids)
    return dict(
        logit_bias={int(k): float(v) for k, v in (p.logit_bias or {}).items()},
        ignore_eos=p.ignore_eos,
        stop_token_ids=list(p.stop_token_ids),
        min_tokens=min_tokens,
        priority=p.priority,
        min_length=input_length + min_tokens if min_tokens and ends else 0,
        min_length_ids=sorted(ends) if min_tokens else [],
    )
