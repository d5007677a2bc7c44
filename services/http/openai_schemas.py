"""OpenAI-style request bodies (TGI's ChatRequest / CompletionRequest) and the response and chunk shapes.

Parsing follows TGI's serde types (unknown fields ignored, unsigned fields reject negatives with a 422);
the mapping to TGI's Parameters follows TGI's `ChatRequest::try_into_generate` and `completions` (reference
§1.6/§1.7). Where TGI is needlessly strict for OpenAI clients, we accept more: `stop` may be a bare string,
`stream_options` may be null, `response_format: {"type": "text"}` means no constraint, and completions honour
`echo`. TGI's tool grammar and tool-call parsing are in services.http.openai_tools.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import msgspec
import orjson

from libs.protocol.messages import FinalInfo, TextRow, TokenText
from libs.protocol.params import Parameters

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # msgspec stops at int64; seeds above it are rare


class OpenAIError(Exception):
    """A request refused before generation, as TGI's ErrorResponse with an HTTP status."""

    def __init__(self, status: int, message: str, error_type: str):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


# ---- request bodies ---------------------------------------------------------------------------
class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class ChatMessage(msgspec.Struct):
    """Checks a message's shape only: the message travels to the tokenizer as sent."""

    role: str
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: Any = None  # OpenAI's name; TGI's is `arguments` (alias `parameters`)
    arguments: Any = None


class Tool(msgspec.Struct):
    function: FunctionDefinition
    type: str = "function"


class FunctionName(msgspec.Struct):
    name: str


class ToolChoiceObject(msgspec.Struct):
    function: FunctionName
    type: str = "function"


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


def _convert(value, kind, field: str):
    """msgspec.convert with the error's path rooted at the body, as decoding the whole body would report it."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise ValueError(str(e).replace("`$", f"`$.{field}")) from None


class ChatBody(msgspec.Struct):
    messages: list[dict[str, Any]]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: list[float] | None = None  # ignored, as TGI (whose type is an array, not OpenAI's map)
    logprobs: bool | None = None
    top_logprobs: U32 | None = None
    max_tokens: U32 | None = None
    max_completion_tokens: U32 | None = None  # OpenAI's newer name for max_tokens
    n: U32 | None = None  # ignored, as TGI
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    seed: U64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_prompt: str | None = None
    tool_choice: str | ToolChoiceObject | None = None
    response_format: dict[str, Any] | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # not TGI's (ignored, as TGI does); only the `text-generation` client sends this key, see `sends_done`
    repetition_penalty: float | None | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self):
        # the messages and tools stay plain dicts (forwarded as sent) but must have TGI's shapes
        messages = _convert(self.messages, list[ChatMessage], "messages")
        for i, m in enumerate(messages):
            if m.content is None and m.tool_calls is None:
                raise ValueError(f"data did not match any variant of untagged enum MessageBody - at `$.messages[{i}]`")
        if self.tools is not None:
            _convert(self.tools, list[Tool], "tools")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def sends_done(self) -> bool:
        """Whether the stream ends with `data: [DONE]`, as TGI's always does.

        TGI's own `text-generation` client (0.7) cannot read that line: it json-parses every `data:` line, so
        its chat streaming fails against TGI itself. That client is recognised by what only it sends
        (`model: "tgi"` and a `repetition_penalty` key, which is no OpenAI chat field) and its stream simply
        ends; every other client gets the [DONE] line.
        """
        return not (self.model == "tgi" and self.repetition_penalty is not msgspec.UNSET)


class CompletionBody(msgspec.Struct):
    prompt: str | list[str]
    model: str | None = None
    max_tokens: U32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: U64 | None = None
    suffix: str | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    echo: bool | None = None  # OpenAI's: the prompt is prepended to the text (TGI ignores it)

    def __post_init__(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("Empty array detected. Do not use an empty array for the prompt.")

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


def parse(raw: bytes, kind: type[msgspec.Struct]):
    """Decode a JSON body as TGI's axum does: malformed JSON is a 400, a wrong shape a 422."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise OpenAIError(422, f"Failed to deserialize the JSON body into the target type: {e}", "validation") from None
    except msgspec.DecodeError as e:
        raise OpenAIError(400, f"Failed to parse the request body as JSON: {e}", "validation") from None


# ---- request → TGI parameters -----------------------------------------------------------------
def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _sampling(temperature: float | None) -> tuple[bool, float | None]:
    """TGI: temperature 0 means greedy; anything else, absent included, samples."""
    if temperature is not None and temperature == 0.0:
        return False, None
    return True, temperature


def adapter(model: str | None, model_id: str) -> str | None:
    """TGI sends `model` on as adapter_id unless it is "tgi"; naming the served model is no adapter either."""
    return None if model in (None, "", "tgi", model_id) else model


def chat_parameters(body: ChatBody, grammar: dict | None, model_id: str) -> Parameters:
    do_sample, temperature = _sampling(body.temperature)
    if grammar is None and body.response_format is not None and body.response_format.get("type") != "text":
        grammar = body.response_format  # TGI's GrammarType; the tokenizer validates (or refuses) it
    return Parameters(
        max_new_tokens=body.max_tokens if body.max_tokens is not None else body.max_completion_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=_stop(body.stop),
        details=True,
        return_full_text=False,
        # TGI's mapping (lib.rs): an OpenAI presence penalty of 0 is a repetition penalty of 2
        repetition_penalty=None if body.presence_penalty is None else body.presence_penalty + 2.0,
        frequency_penalty=body.frequency_penalty,
        top_n_tokens=body.top_logprobs,
        grammar=grammar,
        adapter_id=adapter(body.model, model_id),
    )


def completion_parameters(body: CompletionBody, model_id: str) -> Parameters:
    do_sample, temperature = _sampling(body.temperature)
    # TGI also asks for decoder_input_details when not streaming, only to count prompt tokens from the
    # prefill list; FinalInfo.input_length gives that count without the LM head over the whole prompt.
    return Parameters(
        max_new_tokens=body.max_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=_stop(body.stop),
        details=True,
        return_full_text=False,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        adapter_id=adapter(body.model, model_id),
    )


# ---- responses --------------------------------------------------------------------------------
def openai_finish(reason: str) -> str:
    """TGI's FinishReason::format(true): only eos_token becomes "stop"."""
    return "stop" if reason == "eos_token" else reason


def usage(final: FinalInfo) -> dict:
    return {
        "prompt_tokens": final.input_length,
        "completion_tokens": final.generated_tokens,
        "total_tokens": final.input_length + final.generated_tokens,
    }


def _lp(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def _alternative(t: TokenText) -> dict:
    return {"token": t.text, "logprob": _lp(t.logprob)}


def token_logprob(row: TextRow) -> dict:
    return {"token": row.text, "logprob": _lp(row.logprob), "top_logprobs": [_alternative(t) for t in row.top_tokens]}


def token_rows(rows: list[TextRow]) -> list[TextRow]:
    return [r for r in rows if r.token_id >= 0]  # a bare end row (token -1) carries no token


class Envelope:
    """What every response of one request repeats: id, created, model, system_fingerprint."""

    def __init__(self, model: str, fingerprint: str):
        self.model, self.fingerprint = model, fingerprint

    def head(self, obj: str) -> dict:
        # TGI's id is always ""; created is unix seconds at the time of writing
        return {"object": obj, "id": "", "created": int(time.time()), "model": self.model}

    def chat_completion(self, rows: list[TextRow], logprobs: bool, tool_calls: list[dict] | None = None) -> dict:
        final = rows[-1].final
        if tool_calls is not None:
            message = {"role": "assistant", "tool_calls": tool_calls}
        else:
            message = {"role": "assistant", "content": final.generated_text}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [token_logprob(r) for r in token_rows(rows)]} if logprobs else None,
            "finish_reason": openai_finish(final.finish_reason),
        }
        out = self.head("chat.completion")
        out.update(system_fingerprint=self.fingerprint, choices=[choice], usage=usage(final))
        return out

    def chat_chunk(self, row: TextRow, logprobs: bool) -> dict:
        """One token as TGI streams it; `tool_calls: null` too, which the `text-generation` client requires."""
        delta = {"role": "assistant", "content": "" if row.special else row.text, "tool_calls": None}
        lp = None
        if logprobs and row.token_id >= 0:
            lp = {"content": [token_logprob(row)]}
        finish = openai_finish(row.final.finish_reason) if row.final is not None else None
        out = self.head("chat.completion.chunk")
        out.update(
            system_fingerprint=self.fingerprint,
            choices=[{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            usage=None,
        )
        return out

    def usage_chunk(self, final: FinalInfo) -> dict:
        out = self.head("chat.completion.chunk")
        out.update(system_fingerprint=self.fingerprint, choices=[], usage=usage(final))
        return out

    def completion(self, results: list[tuple[str, list[TextRow]]], echo: bool) -> dict:
        """One choice per prompt, in prompt order; usage summed over the prompts."""
        choices, total = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for index, (prompt, rows) in enumerate(results):
            final = rows[-1].final
            text = prompt + final.generated_text if echo else final.generated_text
            choices.append(
                {"index": index, "text": text, "logprobs": None, "finish_reason": openai_finish(final.finish_reason)}
            )
            for key, value in usage(final).items():
                total[key] += value
        out = self.head("text_completion")
        out.update(system_fingerprint=self.fingerprint, choices=choices, usage=total)
        return out

    def completion_chunk(self, index: int, row: TextRow, prefix: str = "") -> dict:
        """TGI's stream: finish_reason "" until the last chunk, which has TGI's own name and the usage."""
        final = row.final
        choice = {"index": index, "text": prefix + row.text, "logprobs": None, "finish_reason": ""}
        out = self.head("text_completion")
        out.update(choices=[choice], system_fingerprint=self.fingerprint)
        if final is not None:
            choice["finish_reason"] = final.finish_reason
            out["usage"] = usage(final)
        return out


def sse(event: dict | str) -> bytes:
    """One SSE event as the TGI routes write it: `data: ` + compact JSON, then a blank line."""
    body = event.encode() if isinstance(event, str) else orjson.dumps(event)
    return b"data: " + body + b"\n\n"
