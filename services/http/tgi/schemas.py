"""TGI's API: its request bodies and response shapes as typed structs, and the builders of the responses.

Types follow TGI's serde structs (unknown fields ignored; bools, `stop` and `parameters` not nullable, every
other parameter nullable; unsigned fields reject negatives: a 422 before validation). These structs are what the
routes (services.http.tgi.routes) decode and encode and what the OpenAPI document (services.http.openapi) is
generated from. Struct names are TGI's schema names. Fields with a default are omitted when empty (TGI's
skip_serializing_if); fields without one are always written, as null when None. docs/http.md tells why.

A new request parameter is a field of GenerateParameters, carried to the tokenizer by `to_wire` (as
`grammar` and `adapter_id` are; the tokenizer validates them). The OpenAI API (services.http.openai.requests)
maps its own fields onto the same Parameters, and reads its bodies with `parse_body` too.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from libs.protocol.messages import FinalInfo, TextRow, TokenText
from libs.protocol.params import Parameters
from services.http.errors import Failure

VERSION = "3.3.6-dev0"  # the TGI API version we implement
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
# usize/u64: msgspec bounds stop at int64, so the top is checked by check_u64 (in __post_init__)
U64 = Annotated[int, msgspec.Meta(ge=0, extra_json_schema={"maximum": 2**64 - 1})]
I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
FinishReason = Literal["length", "eos_token", "stop_sequence"]


def check_u64(body: msgspec.Struct, *names: str) -> None:
    """The top of U64 fields, from a struct's __post_init__ (msgspec reports the ValueError as a ValidationError)."""
    for name in names:
        value = getattr(body, name)
        if value is not None and value >= 2**64:
            raise ValueError(f"{name}: invalid value: integer `{value}`, expected u64")


def parse_body(raw: bytes, kind: type):
    """Decode a JSON body as TGI's axum does: malformed JSON is a 400 and a wrong type a 422 (Failures).

    JSON nested deeper than msgspec recurses raises RecursionError: TGI's 400 too (serde_json's limit),
    answered by the route or by the errors middleware."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise Failure(f"Failed to deserialize the JSON body into the target type: {e}", "validation") from None
    except msgspec.DecodeError as e:
        raise Failure(f"Failed to parse the request body as JSON: {e}", "validation", 400) from None


# ---- requests ---------------------------------------------------------------------------------
class GrammarType(msgspec.Struct):
    """TGI's adjacently tagged grammar, plus `gbnf` and `lark` (beyond TGI); compiled by the tokenizer.

    json / json_object: a JSON schema (object or JSON string); json_schema: {name?, schema}; regex; gbnf (llama.cpp's
    GBNF); lark (llguidance's Lark)."""

    type: Literal["json", "json_object", "regex", "json_schema", "gbnf", "lark"]
    value: Any


GbnfText = Annotated[str, msgspec.Meta(description='A GBNF grammar (llama.cpp\'s), e.g. `root ::= "yes" | "no"`')]


class GenerateParameters(msgspec.Struct, kw_only=True):
    best_of: U64 | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: I32 | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: U32 | None = None
    return_full_text: bool | None = None
    stop: list[str] = []
    truncate: U64 | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: U64 | None = None
    top_n_tokens: U32 | None = None
    grammar: GrammarType | GbnfText | None = None  # a bare string is a GBNF grammar (beyond TGI)
    adapter_id: str | None = None
    priority: I32 = 0  # beyond TGI: vLLM's request priority, lower first (--scheduling-policy priority)

    def __post_init__(self):
        check_u64(self, "best_of", "truncate", "seed")

    def to_wire(self) -> Parameters:
        fields = msgspec.structs.asdict(self)
        fields["grammar"] = msgspec.to_builtins(self.grammar)
        return Parameters(**fields)


class GenerateRequest(msgspec.Struct, kw_only=True):
    inputs: str
    # TGI quirk kept on purpose: an omitted `parameters` key means do_sample=true (its
    # default_parameters()), while a present but empty object means greedy; null is a 422.
    parameters: GenerateParameters | msgspec.UnsetType = msgspec.UNSET

    def wire_parameters(self) -> Parameters:
        if self.parameters is msgspec.UNSET:
            return GenerateParameters(do_sample=True).to_wire()
        return self.parameters.to_wire()


class CompatGenerateRequest(GenerateRequest, kw_only=True):
    stream: bool = False


# ---- responses --------------------------------------------------------------------------------
class Token(msgspec.Struct):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(msgspec.Struct):
    id: int
    text: str
    logprob: float | None  # null for the first prompt token


class BestOfSequence(msgspec.Struct, kw_only=True, omit_defaults=True):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = []


class Details(msgspec.Struct, kw_only=True, omit_defaults=True):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = []  # only with top_n_tokens > 0
    best_of_sequences: list[BestOfSequence] | None = None  # only with best_of > 1


class GenerateResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    generated_text: str
    details: Details | None = None  # only with details or decoder_input_details


class StreamDetails(msgspec.Struct, kw_only=True):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    token: Token
    top_tokens: list[Token] = []
    generated_text: str | None  # only on the last event
    details: StreamDetails | None  # only on the last event, and only with details


class SimpleToken(msgspec.Struct):
    id: int
    text: str
    start: int  # byte offsets into `inputs`, as TGI
    stop: int


class Info(msgspec.Struct, kw_only=True, omit_defaults=True):
    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
    model_dtype: str | None = None  # beyond TGI today (its older /info had it): what the weights are served in
    lora_adapters: list[str] = []  # beyond TGI: the LoRA adapters loaded (left out when there are none)
    quantization: str | None = None  # the --quantize method the weights are served with (left out when none)
    input_modalities: list[str] | None = None  # beyond TGI: ["text", "image"] for a vision model (else left out)


class ModelInfo(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    owned_by: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's shape); left out for the base model itself
    input_modalities: list[str] | None = None  # beyond TGI: ["text", "image"] for a vision model (else left out)


class ModelsInfo(msgspec.Struct):
    object: str
    data: list[ModelInfo]


# ---- builders ---------------------------------------------------------------------------------
def clean_logprob(value: float | None) -> float | None:
    """NaN (no logprob computed) is null."""
    return None if value is None or math.isnan(value) else value


def token(row: TextRow) -> Token:
    return Token(id=row.token_id, text=row.text, logprob=clean_logprob(row.logprob), special=row.special)


def alternative(t: TokenText) -> Token:
    return Token(id=t.id, text=t.text, logprob=clean_logprob(t.logprob), special=t.special)


def full_text(prompt: str, final: FinalInfo, return_full_text: bool) -> str:
    return prompt + final.generated_text if return_full_text else final.generated_text


def token_rows(rows: list[TextRow]) -> list[TextRow]:
    return [r for r in rows if r.token_id >= 0]  # a bare end row (token -1) carries no token


def mean_logprob(rows: list[TextRow]) -> float:
    """TGI's best_of score: the mean logprob of the generated tokens."""
    logprobs = [r.logprob for r in token_rows(rows)]
    return sum(logprobs) / len(logprobs) if logprobs else -math.inf


def _sequence(rows: list[TextRow], params: Parameters) -> dict:
    final = rows[-1].final
    tokens = token_rows(rows)
    out = {
        "finish_reason": final.finish_reason,
        "generated_tokens": final.generated_tokens,
        "seed": final.seed,
        "prefill": [PrefillToken(id=t.id, text=t.text, logprob=clean_logprob(t.logprob)) for t in final.prefill],
        "tokens": [token(r) for r in tokens],
    }
    if params.top_n_tokens:
        out["top_tokens"] = [[alternative(t) for t in r.top_tokens] for r in tokens]
    return out


def generate_response(
    prompt: str,
    params: Parameters,
    rows: list[TextRow],
    return_full_text: bool,
    others: list[list[TextRow]] | None = None,
) -> GenerateResponse:
    """TGI's GenerateResponse; `others` are the best_of sequences that lost (best_of > 1)."""
    final = rows[-1].final
    out = GenerateResponse(generated_text=full_text(prompt, final, return_full_text))
    if params.details or params.decoder_input_details:
        out.details = Details(**_sequence(rows, params))
        if others is not None:
            out.details.best_of_sequences = [
                BestOfSequence(generated_text=full_text(prompt, o[-1].final, return_full_text), **_sequence(o, params))
                for o in others
            ]
    return out


def stream_event(row: TextRow, prompt: str, params: Parameters, return_full_text: bool) -> StreamResponse:
    """TGI's StreamResponse for one token; the last one carries generated_text (and details)."""
    final = row.final
    event = StreamResponse(
        index=row.index,
        token=token(row),
        top_tokens=[alternative(t) for t in row.top_tokens],
        generated_text=None,
        details=None,
    )
    if final is not None:
        event.generated_text = full_text(prompt, final, return_full_text)
        if params.details:
            event.details = StreamDetails(
                finish_reason=final.finish_reason,
                generated_tokens=final.generated_tokens,
                seed=final.seed,
                input_length=final.input_length,
            )
    return event


def simple_tokens(text: str, ids, starts, stops) -> list[SimpleToken]:
    """TGI's /tokenize answer from character offsets: TGI reports byte offsets (its Rust tokenizer's)."""
    byte_at = [0]
    for ch in text:
        byte_at.append(byte_at[-1] + len(ch.encode()))
    n = len(text)
    out = []
    for i, start, stop in zip(ids, starts, stops):
        start, stop = min(int(start), n), min(int(stop), n)
        out.append(SimpleToken(id=int(i), text=text[start:stop], start=byte_at[start], stop=byte_at[stop]))
    return out
