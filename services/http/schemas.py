"""Request bodies as TGI's router deserializes them, and TGI's response shapes.

Types follow TGI's serde structs: unknown fields are ignored, bools and `stop` are not nullable,
every other parameter accepts null, unsigned fields reject negatives (a 422 before validation).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from libs.protocol.messages import FinalInfo, Parameters, TextRow

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64: the top is checked in __post_init__
I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


class GenerateParameters(msgspec.Struct):
    max_new_tokens: U32 | None = None
    do_sample: bool = False
    temperature: float | None = None
    top_k: I32 | None = None
    top_p: float | None = None
    seed: U64 | None = None
    stop: list[str] = []
    details: bool = False
    return_full_text: bool | None = None
    truncate: U32 | None = None

    def __post_init__(self):
        if self.seed is not None and self.seed >= 2**64:
            raise ValueError("seed: invalid value, expected u64")  # msgspec reports it as a ValidationError

    def to_wire(self) -> Parameters:
        return Parameters(**msgspec.structs.asdict(self))


class GenerateBody(msgspec.Struct):
    inputs: str
    # TGI quirk kept on purpose: an omitted `parameters` key means do_sample=true (its
    # default_parameters()), while a present but empty object means greedy.
    parameters: GenerateParameters | None = None
    stream: bool = False  # only read on the compat route POST /

    def wire_parameters(self) -> Parameters:
        if self.parameters is None:
            return GenerateParameters(do_sample=True).to_wire()
        return self.parameters.to_wire()


class BodyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_body(raw: bytes, kind: type[msgspec.Struct]):
    """Decode a JSON body; malformed JSON is a 400 and a wrong type a 422, as in TGI (axum)."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise BodyError(422, f"Failed to deserialize the JSON body into the target type: {e}") from None
    except msgspec.DecodeError as e:
        raise BodyError(400, f"Failed to parse the request body as JSON: {e}") from None


def token_json(row: TextRow) -> dict:
    return {"id": row.token_id, "text": row.text, "logprob": row.logprob, "special": row.special}


def full_text(prompt: str, final: FinalInfo, return_full_text: bool) -> str:
    return prompt + final.generated_text if return_full_text else final.generated_text


def generate_response(prompt: str, params: Parameters, rows: list[TextRow], return_full_text: bool) -> dict:
    """TGI's GenerateResponse; `details` only when asked for."""
    final = rows[-1].final
    out = {"generated_text": full_text(prompt, final, return_full_text)}
    if params.details:
        out["details"] = {
            "finish_reason": final.finish_reason,
            "generated_tokens": final.generated_tokens,
            "seed": final.seed,
            "prefill": [],
            "tokens": [token_json(r) for r in rows if r.token_id >= 0],
        }
    return out


def stream_event(row: TextRow, prompt: str, params: Parameters, return_full_text: bool) -> dict:
    """TGI's StreamResponse for one token; the last one carries generated_text (and details)."""
    final = row.final
    event = {"index": row.index, "token": token_json(row), "generated_text": None, "details": None}
    if final is not None:
        event["generated_text"] = full_text(prompt, final, return_full_text)
        if params.details:
            event["details"] = {
                "finish_reason": final.finish_reason,
                "generated_tokens": final.generated_tokens,
                "seed": final.seed,
                "input_length": final.input_length,
            }
    return event
