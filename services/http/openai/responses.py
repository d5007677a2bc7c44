"""OpenAI's responses as TGI writes them: the completion and chunk structs and their builders (`Envelope`).

These structs are what the routes (services.http.openai.routes) encode and what the OpenAPI document
(services.http.openapi) is generated from, so the two cannot drift apart. Field order is the order written on
the wire. The requests and their mapping to TGI's parameters are in services.http.openai.requests.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

from libs.protocol.messages import FinalInfo, TextRow, TokenText
from services.http.openai.requests import REF
from services.http.tgi.schemas import SimpleToken, clean_logprob, token_rows


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionTopLogprob(msgspec.Struct):
    token: str
    logprob: float | None


class ChatCompletionLogprob(msgspec.Struct):
    token: str
    logprob: float | None
    top_logprobs: list[ChatCompletionTopLogprob]


class ChatCompletionLogprobs(msgspec.Struct):
    content: list[ChatCompletionLogprob]


class ToolCallFunction(msgspec.Struct):
    description: str | None | msgspec.UnsetType  # TGI writes null; the model's own format leaves it out
    name: str
    arguments: str  # a JSON text, as TGI


class ToolCall(msgspec.Struct):
    id: str
    type: str
    function: ToolCallFunction


class OutputMessage(msgspec.Struct, kw_only=True):
    """The answer: its content, or (a tool was called) its tool calls and no content key, as TGI."""

    role: str
    content: str | None | msgspec.UnsetType = msgspec.UNSET
    # reasoning apart (services.http.reasoning): vLLM's name, and the newer one clients read
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: OutputMessage
    logprobs: ChatCompletionLogprobs | None  # only with `logprobs`
    finish_reason: str


class ChatCompletion(msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion"):
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class DeltaFunction(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str


class DeltaToolCall(msgspec.Struct, kw_only=True):
    index: int
    id: str | msgspec.UnsetType  # TGI repeats it on every delta; the model's own format on the first only
    type: str | msgspec.UnsetType
    function: DeltaFunction


class ChatCompletionDelta(msgspec.Struct, kw_only=True):
    """A content delta: every key is written, `tool_calls: null` too (tool calls stream as ChatCompletionToolDelta)."""

    # (the `text-generation` client requires tool_calls; TGI itself streams tool calls as tool_calls deltas)
    role: str
    content: str | None = None
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # a reasoning piece (then content is null)
    reasoning: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionToolDelta(msgspec.Struct, kw_only=True):
    """A tool call's piece, as TGI streams it: no `content` key; the first names the function (arguments `{`),
    the next ones have `name: null` and the arguments text as it comes."""

    role: str
    tool_calls: list[DeltaToolCall]


# a content delta or a tool call's (untagged, as TGI's): documented as either struct
Delta = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={
            "anyOf": [
                {"$ref": REF.format(name="ChatCompletionDelta")},
                {"$ref": REF.format(name="ChatCompletionToolDelta")},
            ]
        }
    ),
]


class ChatCompletionChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta  # ChatCompletionDelta | ChatCompletionToolDelta
    logprobs: ChatCompletionLogprobs | None
    finish_reason: str | None  # on the last token's chunk only


class ChatCompletionChunk(msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion.chunk"):
    """One token; or, last with `stream_options.include_usage`, no choices and the usage."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's legacy completions logprobs: per token (the prompt's first with echo) its text, its logprob
    (null for the first prompt token), its alternatives ({text: logprob}; for a prompt token its position's
    greedy token and itself, null for the first) and its character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionComplete(msgspec.Struct, kw_only=True):
    index: int  # the prompt's
    text: str
    logprobs: CompletionLogprobs | None = None  # only with `logprobs` (TGI: always null)
    finish_reason: str


class Completion(msgspec.Struct, kw_only=True, tag_field="object", tag="text_completion"):
    """One choice per prompt, in prompt order; usage summed over the prompts."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionComplete]
    usage: Usage


class CompletionChunk(msgspec.Struct, kw_only=True, tag_field="object", tag="text_completion"):
    """One token of one prompt. `finish_reason` is "" until the prompt's last chunk, which carries the finish
    reason (not mapped to "stop") and the usage."""

    # the key order differs from Completion's (choices before system_fingerprint), as it always has
    id: str
    created: int
    model: str
    choices: list[CompletionComplete]
    system_fingerprint: str
    usage: Usage | msgspec.UnsetType = msgspec.UNSET


class ChatTokenizeResponse(msgspec.Struct):
    tokenize_response: list[SimpleToken]
    templated_text: str


def openai_finish(reason: str) -> str:
    """TGI's FinishReason::format(true): only eos_token becomes "stop"."""
    return "stop" if reason == "eos_token" else reason


def apply_answer(choice: ChatCompletionChoice, answer) -> None:
    """A choice's message from an answer read in the model's own format (services.http.openai.answer.Answer):
    content (null when only calls), reasoning, calls; finish_reason `tool_calls` when the turn ends in calls."""
    message = choice.message
    message.content = answer.content if answer.content or not answer.calls else None
    if answer.reasoning is not None:
        message.reasoning_content = message.reasoning = answer.reasoning
    if answer.calls:
        message.tool_calls = [
            ToolCall(c.id, "function", ToolCallFunction(msgspec.UNSET, c.name, c.arguments)) for c in answer.calls
        ]
        if choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"


def usage(final: FinalInfo) -> Usage:
    return Usage(final.input_length, final.generated_tokens, final.input_length + final.generated_tokens)


def usage_of_choices(finals: list[FinalInfo]) -> Usage:
    """The `n` choices of one prompt: the prompt counted once, every choice's tokens."""
    prompt, completion = finals[0].input_length, sum(f.generated_tokens for f in finals)
    return Usage(prompt, completion, prompt + completion)


def token_logprob(row: TextRow) -> ChatCompletionLogprob:
    tops = [ChatCompletionTopLogprob(t.text, clean_logprob(t.logprob)) for t in row.top_tokens]
    return ChatCompletionLogprob(row.text, clean_logprob(row.logprob), tops)


def completion_logprobs(
    prefill: list[TokenText], greedy: list[TokenText | None], start: int, rows: list[TextRow]
) -> CompletionLogprobs:
    """The logprobs of the prompt tokens `prefill` (echo; `greedy`: the greedy token at each position) then of
    the generated `rows`. Offsets: a prompt token advances by its text (a special token by nothing: it is not in
    the prompt's text); the generated tokens start at `start` (the echoed prompt's length) and advance by their
    incremental text."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    at = 0
    for k, t in enumerate(prefill):
        best = greedy[k] if k < len(greedy) else None
        out.tokens.append(t.text)
        out.token_logprobs.append(clean_logprob(t.logprob))
        tops = None
        if best is not None and t.logprob is not None:
            tops = {best.text: clean_logprob(best.logprob)}
            tops.setdefault(t.text, clean_logprob(t.logprob))
        out.top_logprobs.append(tops)
        out.text_offset.append(at)
        at += 0 if t.special else len(t.text)
    at = start
    for r in rows:
        out.tokens.append(r.text)
        out.token_logprobs.append(clean_logprob(r.logprob))
        tops = {t.text: clean_logprob(t.logprob) for t in r.top_tokens}
        tops.setdefault(r.text, clean_logprob(r.logprob))  # the chosen token too, as vLLM
        out.top_logprobs.append(tops)
        out.text_offset.append(at)
        at += len(r.text)
    return out


class Envelope:
    """What every response of one request repeats: id, created, model, system_fingerprint."""

    def __init__(self, model: str, fingerprint: str):
        self.model, self.fingerprint = model, fingerprint

    def head(self) -> dict:
        # TGI's id is always ""; created is unix seconds at the time of writing
        return {"id": "", "created": int(time.time()), "model": self.model, "system_fingerprint": self.fingerprint}

    def chat_completion(self, rows: list[TextRow], logprobs: bool, tool_calls: list[ToolCall] | None = None):
        return self.chat_completions([(rows, tool_calls)], logprobs)

    def chat_completions(self, answers: list[tuple[list[TextRow], list[ToolCall] | None]], logprobs: bool):
        """One choice per answer (`n`), each its rows and its tool calls (None: none); usage sums them."""
        choices = []
        for index, (rows, tool_calls) in enumerate(answers):
            final = rows[-1].final
            if tool_calls is not None:
                message = OutputMessage(role="assistant", tool_calls=tool_calls)
            else:
                message = OutputMessage(role="assistant", content=final.generated_text)
            lp = ChatCompletionLogprobs([token_logprob(r) for r in token_rows(rows)]) if logprobs else None
            finish = openai_finish(final.finish_reason)
            choices.append(ChatCompletionChoice(index=index, message=message, logprobs=lp, finish_reason=finish))
        total = usage_of_choices([rows[-1].final for rows, _ in answers])
        return ChatCompletion(**self.head(), choices=choices, usage=total)

    def chat_chunk(
        self, row: TextRow, logprobs: bool, content: str | None = None, index: int = 0
    ) -> ChatCompletionChunk:
        """One token of choice `index` as TGI streams it: a special token's content is "" (`content`: the text to
        send instead)."""
        if content is None:
            content = "" if row.special else row.text
        delta = ChatCompletionDelta(role="assistant", content=content)
        lp = None
        if logprobs and row.token_id >= 0:
            lp = ChatCompletionLogprobs([token_logprob(row)])
        finish = openai_finish(row.final.finish_reason) if row.final is not None else None
        choice = ChatCompletionChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)
        return ChatCompletionChunk(**self.head(), choices=[choice], usage=None)

    def tool_chunk(
        self, row: TextRow, call_id: str, name: str | None, arguments: str, index: int = 0
    ) -> ChatCompletionChunk:
        """A tool call's piece (TGI's tool delta); the stream's last one carries the finish reason."""
        call = DeltaToolCall(
            index=0, id=call_id, type="function", function=DeltaFunction(name=name, arguments=arguments)
        )
        delta = ChatCompletionToolDelta(role="assistant", tool_calls=[call])
        finish = openai_finish(row.final.finish_reason) if row.final is not None else None
        choice = ChatCompletionChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=finish)
        return ChatCompletionChunk(**self.head(), choices=[choice], usage=None)

    def usage_chunk(self, finals: list[FinalInfo]) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head(), choices=[], usage=usage_of_choices(finals))

    def completion(
        self,
        results: list[tuple[str | list[int], list[TextRow]]],
        echo: bool,
        logprobs: int | None = None,
        prompt_only: bool = False,
        n: int = 1,
    ) -> Completion:
        """One choice per prompt and `n` (a text, or token ids whose echo is their prefill texts), the n choices of
        each prompt in a row; usage counts each prompt once. `prompt_only` (max_tokens 0): the one generated token
        is left out of the text, the logprobs and the usage."""
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, (prompt, rows) in enumerate(results):
            final = rows[-1].final
            generated = [] if prompt_only else token_rows(rows)
            generated_text = "" if prompt_only else final.generated_text
            prompt_text = prompt if isinstance(prompt, str) else "".join(t.text for t in final.prefill if not t.special)
            text = prompt_text + generated_text if echo else generated_text
            lp = None
            if logprobs is not None:
                prompt = (final.prefill, final.prefill_greedy) if echo else ([], [])
                lp = completion_logprobs(*prompt, len(prompt_text) if echo else 0, generated)
            finish = "length" if prompt_only else openai_finish(final.finish_reason)
            choices.append(CompletionComplete(index=index, text=text, logprobs=lp, finish_reason=finish))
            prompt_tokens += 0 if index % n else final.input_length
            completion_tokens += 0 if prompt_only else final.generated_tokens
        total = Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        return Completion(**self.head(), choices=choices, usage=total)

    def completion_chunk(
        self, index: int, row: TextRow, prefix: str = "", logprobs: bool = False, at: int = 0
    ) -> CompletionChunk:
        """One token; with `logprobs`, its logprobs (`at`: its offset in the choice's streamed text)."""
        final = row.final
        choice = CompletionComplete(index=index, text=prefix + row.text, finish_reason="")
        if logprobs:
            choice.logprobs = completion_logprobs([], [], at + len(prefix), token_rows([row]))
        out = CompletionChunk(**self.head(), choices=[choice])
        if final is not None:
            choice.finish_reason = final.finish_reason
            out.usage = usage(final)
        return out
