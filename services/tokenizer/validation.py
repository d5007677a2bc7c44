"""TGI's request validation (router/src/validation.rs), as pure functions.

Two stages, because the length rules need the token ids:
- `check_parameters` runs the checks that need no tokens, before tokenizing;
- `resolve` truncates the ids, runs the length checks and resolves max_new_tokens and sampling.
Each check raises `ValidationError` with TGI's exact message, in TGI's order (reference §2.2), so a request
that breaks two rules gets the same message TGI would give.
"""

from __future__ import annotations

import secrets
from typing import NamedTuple

import numpy as np

from libs.protocol.messages import Parameters, RequestError, SamplingParams

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

    def to_request_error(self, request_id: str) -> RequestError:
        return RequestError(request_id=request_id, message=self.full_message, error_type=self.error_type)


def _f32(x: float) -> float:
    # TGI parses these floats as f32, so e.g. top_p=0.99999999 rounds to 1.0 and is rejected; do the same.
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def check_parameters(p: Parameters, inputs: str, *, max_stop_sequences: int, max_input_tokens: int) -> None:
    """TGI's checks that need no tokens, in TGI's order; raises ValidationError on the first failure."""
    if p.temperature is not None and _f32(p.temperature) <= 0.0:
        raise ValidationError("`temperature` must be strictly positive")
    if p.top_p is not None:
        top_p = _f32(p.top_p)
        if top_p <= 0.0 or top_p >= 1.0:  # written as TGI writes it (a NaN passes there too)
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    # TGI's u32 makes 0 the only bad value; a negative one (a 422 deserialize error there) gets the same message here.
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {max_stop_sequences} stop sequences. Given: {len(p.stop)}")
    if inputs == "":  # TGI tests the string, so whitespace-only inputs pass
        raise ValidationError("`inputs` cannot be empty")
    if p.truncate is not None and (p.truncate <= 0 or p.truncate > max_input_tokens):
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {max_input_tokens}. Given: {p.truncate}"
        )


class Resolved(NamedTuple):
    input_ids: list[int]  # the prompt after truncation
    max_new_tokens: int  # never None
    sampling: SamplingParams
    seed: int | None  # the seed to report in details: None when greedy


def is_sampling(p: Parameters) -> bool:
    """Whether the shard samples, as TGI's HeterogeneousNextTokenChooser decides (reference §7.3).

    A warper makes a request sample only when it changes something: temperature != 1.0, top_k != 0,
    top_p < 1.0. So `temperature=1.0` alone stays greedy, as in TGI (its router's looser "is set" rule
    is only used for the best_of check, which Switchyard does not have).
    """
    return (
        p.do_sample
        or (p.temperature is not None and _f32(p.temperature) != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and _f32(p.top_p) < 1.0)
    )


def resolve(p: Parameters, input_ids: list[int], *, max_input_tokens: int, max_total_tokens: int) -> Resolved:
    """Truncate, run TGI's length checks, and resolve max_new_tokens and sampling (call after check_parameters).

    max_new_tokens: None → max_total_tokens − input_length. TGI generates that in chunks of ≤1024 tokens
    (auto-continuation, reference §1.3); Switchyard generates the whole budget in one go. The ≤1024 chunk is
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
    if max_new_tokens < 1:
        # Only reachable when max_input_tokens >= max_total_tokens (TGI's launcher forbids that): the prompt
        # fills the whole budget. TGI would still generate; we cannot, so report it as the budget error.
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and 1 `max_new_tokens`"
        )

    max_new_tokens = min(max_new_tokens, max_total_tokens - input_length)
    if not is_sampling(p):
        return Resolved(ids, max_new_tokens, SamplingParams(do_sample=False), None)
    # TGI draws a random u64 seed when none is given, and reports it only for sampled requests.
    seed = p.seed if p.seed is not None else secrets.randbits(64)
    sampling = SamplingParams(
        do_sample=True,
        temperature=p.temperature if p.temperature is not None else 1.0,
        top_k=p.top_k if p.top_k is not None else 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        seed=seed,
    )
    return Resolved(ids, max_new_tokens, sampling, seed)
