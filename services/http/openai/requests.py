"""OpenAI's request bodies as TGI serves them (TGI's ChatRequest / CompletionRequest) and their mapping to TGI's
Parameters; the responses are in services.http.openai.responses, the reading of tool calls in .tools.

These structs are what the routes (services.http.openai.routes) decode and what the OpenAPI document
(services.http.openapi) is generated from; field order is the order written on the wire. Parsing follows TGI's
serde types; the mapping follows TGI's `ChatRequest::try_into_generate` and `completions`, accepting more where
TGI is needlessly strict for OpenAI clients (docs/http.md).

A new request field goes on ChatRequest / CompletionRequest and into `chat_parameters` / `completion_parameters`
(structured output: `response_format`, which the tokenizer compiles, and `tools` / `tool_choice`, which it
resolves; LoRA: `model`, see `adapter`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from libs.protocol.params import Parameters
from services.http.tgi.schemas import U32, U64, check_u64

REF = "#/components/schemas/{name}"  # where the OpenAPI document (services.http.openapi) keeps each struct


def forwarded(kind: type[msgspec.Struct]) -> Any:
    """A JSON object passed on to the tokenizer as sent (unknown keys included), whose shape is checked
    against `kind` (see ChatRequest.__post_init__) and documented as `kind`."""
    return Annotated[dict[str, Any], msgspec.Meta(extra_json_schema={"$ref": REF.format(name=kind.__name__)})]


# ---- request bodies ---------------------------------------------------------------------------
class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class ChatMessage(msgspec.Struct):
    """A chat message; passed on to the chat template as sent. An assistant turn's earlier reasoning may come as
    `reasoning_content` (DeepSeek's and vLLM's answer field), `reasoning` (vLLM's newer one) or `thinking`
    (transformers' name for gpt-oss); the template gets it under each of those names
    (services.tokenizer.chat_template.native_messages)."""

    role: str
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None


class FunctionDefinition(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: Any = None  # OpenAI's name; TGI's is `arguments` (alias `parameters`)
    arguments: Any = None


class Tool(msgspec.Struct):
    """A tool; passed on to the chat template as sent."""

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


MessageObject = forwarded(ChatMessage)
ToolObject = forwarded(Tool)
GrammarObject = Annotated[
    dict[str, Any],
    msgspec.Meta(
        description="The answer's format, compiled by the tokenizer: TGI's grammar `{type: json|json_object|regex|"
        "json_schema|gbnf|lark, value}`, or OpenAI's `{type: json_object}`, `{type: json_schema, json_schema: "
        "{name, schema, strict}}`, `{type: text}` (no constraint)"
    ),
]


class ChatRequest(msgspec.Struct):
    messages: list[MessageObject]
    model: str | None = None  # not "tgi" nor the served model: a LoRA adapter's name (see `adapter`)
    frequency_penalty: float | None = None
    # OpenAI's map token id → bias (-100…100), applied; TGI's own type, an array, is accepted and ignored as TGI does
    logit_bias: dict[int, float] | list[float] | None = None
    logprobs: bool | None = None
    top_logprobs: U32 | None = None
    max_tokens: U32 | None = None
    max_completion_tokens: U32 | None = None  # OpenAI's newer name for max_tokens
    n: U32 | None = None  # choices, 1 … 128 (services/http/openai/choices.py; TGI ignores it)
    presence_penalty: float | None = None  # repetition_penalty = presence_penalty + 2 (TGI)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: U64 | None = None
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    tools: list[ToolObject] | None = None
    tool_prompt: str | None = None
    tool_choice: str | ToolChoiceObject | None = None  # auto (also null), none, required, or a function's name
    response_format: GrammarObject | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # for templates that take them (RAG)
    parallel_tool_calls: bool | None = None  # false: at most one call (the model's own format)
    thinking_token_budget: int | None = None  # vLLM's: the most tokens of reasoning (see `thinking_budget`)
    reasoning_effort: str | None = None  # OpenAI's: none … max, mapped to budgets (REASONING_EFFORT)
    # not TGI's (ignored, as TGI does); only the `text-generation` client sends this key, see `sends_done`
    repetition_penalty: float | None | msgspec.UnsetType = msgspec.UNSET
    # vLLM's sampling extras (not TGI's); as on CompletionRequest
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    priority: int = 0  # vLLM's: lower runs first (--scheduling-policy priority)

    def __post_init__(self):
        check_u64(self, "seed")
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

    @property
    def characters(self) -> str:
        """The text of the messages, for x-compute-characters (TGI counts the rendered prompt, which only the
        tokenizer sees)."""
        out = []
        for m in self.messages:
            content = m.get("content")
            if isinstance(content, str):
                out.append(content)
            elif isinstance(content, list):
                out.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "".join(out)


PromptObject = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={
            "description": "A text, a list of texts, a list of token ids, or a list of lists of token ids",
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ],
        }
    ),
]


class CompletionRequest(msgspec.Struct):
    prompt: PromptObject  # str | list[str] | list[int] | list[list[int]] (see `prompts`)
    model: str | None = None  # as ChatRequest.model
    max_tokens: U32 | None = None
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    stream: bool = False
    seed: U64 | None = None
    suffix: str | None = None  # refused, as TGI
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    echo: bool | None = None  # OpenAI's: the prompt is prepended to the text (TGI ignores it)
    response_format: GrammarObject | None = None  # as chat's (beyond TGI's completions)
    logit_bias: dict[int, float] | None = None  # OpenAI's map token id → bias (-100…100)
    min_p: float | None = None  # vLLM's: MinPLogitsWarper
    ignore_eos: bool = False  # vLLM's: EOS is an ordinary token, generation runs to max_tokens
    min_tokens: int | None = None  # vLLM's: no EOS nor stop_token_ids before this many tokens
    stop_token_ids: list[int] | None = None  # vLLM's: any of them ends the answer (finish_reason `stop`)
    priority: int = 0  # vLLM's: lower runs first (--scheduling-policy priority)
    logprobs: U32 | None = None  # OpenAI's legacy int: alternatives per token (see responses.completion_logprobs)
    n: U32 | None = None  # choices per prompt, as chat's

    def __post_init__(self):
        check_u64(self, "seed")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("Empty array detected. Do not use an empty array for the prompt.")
        _prompt_shape(self.prompt)

    @property
    def prompts(self) -> list[str | list[int]]:
        """One prompt per request: a text or a list of token ids."""
        return _prompt_shape(self.prompt)


def _prompt_shape(prompt: Any) -> list[str | list[int]]:
    """The prompts of `prompt` (str | list[str] | list[int] | list[list[int]]); ValueError for another shape."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_id(i) for i in prompt):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, list) and p and all(_is_id(i) for i in p) for p in prompt):
        return prompt
    raise ValueError(
        "Expected `prompt` to be a string, a list of strings, a list of token ids or a list of lists of token ids "
        "- at `$.prompt`"
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


# `model` values that mean the base model: none, TGI's documented "tgi", and "dummy", the placeholder that
# huggingface_hub's InferenceClient sends when it was given a URL instead of a model id
BASE_MODEL_NAMES = (None, "", "tgi", "dummy")


def adapter(model: str | None, model_id: str) -> str | None:
    """TGI sends `model` on as adapter_id unless it is "tgi"; naming the served model is no adapter either."""
    return None if model in BASE_MODEL_NAMES or model == model_id else model


def _format(response_format: dict | None) -> dict | None:
    """response_format → Parameters.grammar as sent (the tokenizer compiles every shape); `text` is none."""
    if response_format is None or response_format.get("type") == "text":
        return None
    return response_format


def _extras(body: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The OpenAI / vLLM parameters TGI lacks, as Parameters fields (a list logit_bias is TGI's, ignored)."""
    return dict(
        logit_bias=body.logit_bias if isinstance(body.logit_bias, dict) else None,
        min_p=body.min_p,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        stop_token_ids=list(body.stop_token_ids or []),
        priority=body.priority,
    )


def chat_parameters(body: ChatRequest, model_id: str) -> Parameters:
    do_sample, temperature = _sampling(body.temperature)
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
        grammar=_format(body.response_format),
        adapter_id=adapter(body.model, model_id),
        **_extras(body),
    )


def completion_parameters(body: CompletionRequest, model_id: str) -> Parameters:
    do_sample, temperature = _sampling(body.temperature)
    # TGI also asks for decoder_input_details when not streaming, only to count prompt tokens from the
    # prefill list; FinalInfo.input_length gives that count without the LM head over the whole prompt. Here it
    # is asked for when the prompt's tokens are answered (completion_details).
    return Parameters(
        max_new_tokens=1 if body.max_tokens == 0 else body.max_tokens,  # 0: see prompt_only
        decoder_input_details=completion_details(body),
        top_n_tokens=body.logprobs,
        do_sample=do_sample,
        temperature=temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=_stop(body.stop),
        details=True,
        return_full_text=False,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        grammar=_format(body.response_format),
        adapter_id=adapter(body.model, model_id),
        **_extras(body),
    )


def prompt_only(body: CompletionRequest) -> bool:
    """`max_tokens: 0`: only the prompt is answered (its echo and logprobs). One token is still generated (the
    pipeline always samples after prefill) and the response leaves it out: text, logprobs and usage."""
    return body.max_tokens == 0


def completion_details(body: CompletionRequest) -> bool:
    """Whether the prompt's tokens come back (decoder_input_details): echo with logprobs, or echo of a prompt
    given as token ids (its text is then the tokens' texts). Never when streaming (TGI refuses it there)."""
    if not body.echo or body.stream:
        return False
    return body.logprobs is not None or any(not isinstance(p, str) for p in body.prompts)


# OpenAI's reasoning_effort, every value its SDK sends, as thinking budgets: the tokens of reasoning before the server
# writes its end marker (`none`: at once, no reasoning; `max`: no budget, the reasoning ends when the model ends it)
REASONING_EFFORT: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 65536,
    "max": None,
}


def template_kwargs(body: ChatRequest) -> dict[str, Any] | None:
    """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` as sent, as the variable of
    that name (gpt-oss's template reads it for its `Reasoning:` line; a template renders a value it does not know as
    any other string), which an explicit chat_template_kwargs value overrides."""
    if body.reasoning_effort is None:
        return body.chat_template_kwargs
    return {"reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}


def thinking_budget(body: ChatRequest) -> int | None:
    """The request's thinking budget: `thinking_token_budget`, else `reasoning_effort`'s; ValueError when bad
    (an unknown effort too, which would otherwise reach the template)."""
    if body.reasoning_effort is not None and body.reasoning_effort not in REASONING_EFFORT:
        raise ValueError(f"`reasoning_effort` must be one of {', '.join(REASONING_EFFORT)}")
    if body.thinking_token_budget is not None:
        if body.thinking_token_budget < 1:
            raise ValueError("`thinking_token_budget` must be at least 1")
        return body.thinking_token_budget
    return None if body.reasoning_effort is None else REASONING_EFFORT[body.reasoning_effort]
