"""The request and stream messages of the Switchyard bus. The scheduler ↔ shard step messages are in
`libs.protocol.step_messages`, LoRA's in `libs.protocol.lora`, the base class and wire version in
`libs.protocol.message_base`, the request parameters some of them carry in `libs.protocol.params`; the codec
decodes the kinds of all three message modules.

Each message is a msgspec Struct tagged with its `kind`, so one decoder reads any frame and a
receiver can tell at once what it got. Bulk numeric data (token ids, logprobs, offsets) does not
travel inside the msgpack body: a message lists those fields in `FRAMES`, and the codec
(`libs.protocol.codec`) sends each as a raw little-endian array in an extra frame.

Field comments say who fills a field and what it means; the flow of a request is in the README's architecture section.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from libs.protocol.message_base import Message
from libs.protocol.params import Parameters, SamplingParams

# --------------------------------------------------------------------------------------------
# Requests: http → intake → tokenizer → admit → router → scheduler


class GenerateRequest(Message, tag="generate", kw_only=True):
    """A new request from an http process, before validation (http → intake → a tokenizer)."""

    request_id: str  # 32 hex chars, chosen by http; the key of the request everywhere
    ingress: int  # index of the http process that owns the client connection
    inputs: str  # the prompt text ("" for chat: the tokenizer renders `messages` with the chat template)
    parameters: Parameters
    add_special_tokens: bool = True  # False for chat (the template holds the special tokens), as TGI
    received_at: float = 0.0  # unix time the http process read the request
    # what the client wants back: "generate" (tokens stream), or only the tokenization ("tokenize":
    # the tokenizer answers a TokenizeResult on out.<ingress> and forwards nothing)
    mode: str = "generate"
    stream: bool = False  # the client streams: some of TGI's checks refuse options on stream routes
    messages: list[dict[str, Any]] | None = None  # OpenAI chat messages, as sent (content str or parts)
    tools: list[dict[str, Any]] | None = None  # OpenAI tools, as sent; the tokenizer selects them by tool_choice
    tool_choice: Any = None  # OpenAI tool_choice as sent (None: auto); the tokenizer resolves it
    tool_prompt: str | None = None  # TGI's tool_prompt (None or "": its default), appended to the last message
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    documents: list[dict[str, Any]] | None = None  # for templates that take documents (RAG), as sent
    parallel_tool_calls: bool = True  # in the model's own format: several calls in one turn, or one
    thinking_budget: int | None = None  # the most tokens of reasoning before its end marker is forced
    traceparent: str | None = None  # W3C trace context of the http span, continued by each hop
    prompt_ids: list[int] | None = None  # a prompt given as token ids (OpenAI completions): used as is, not `inputs`
    # the `n` choices of one OpenAI request share this id: one replica prefills their prompt once ("": alone)
    group: str = ""
    # the served model it is for, as its replicas announce it ("": the default model, the router's own); a named
    # model's request goes to one of that model's tokenizers on tokenize.<n> instead of through intake
    model: str = ""


class ImageInput(msgspec.Struct, kw_only=True, array_like=True):
    """One image of a request: where its placeholder tokens sit in the prompt and the shape of its pixels, whose
    values travel flattened in a frame of the carrying message, images in order: `pixel_values` for float32 ones,
    `pixel_bytes` for uint8 ones (image_pixels below reads them back)."""

    digest: str  # content hash of its preprocessed pixels (hex): the prefix-cache key and the encoder cache's
    start: int  # prompt position of its first placeholder token
    tokens: int  # placeholder tokens it fills (the vision encoder's output rows)
    shape: list[int]  # pixel tensor shape, as the model's processor made it
    # the picture's (height, width) before preprocessing, where the model needs it (LLaVA-Next's tiling); last, so a
    # peer without the field still reads the rest
    image_size: list[int] = []
    # "float32": the processor's pixel values; "uint8": its values before rescale and normalize, exact bytes for the
    # families whose processor does those last (a quarter of the size), which the shard applies as it does
    dtype: str = "float32"

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


PIXEL_FRAMES = {"float32": "pixel_values", "uint8": "pixel_bytes"}  # ImageInput.dtype → the frame of its pixels


def check_images(
    images: list[ImageInput], pixel_values: Any, prompt_len: int | None = None, pixel_bytes: Any = None
) -> None:
    """The images' pixels fill their frames exactly and their placeholders lie within the prompt (ValueError)."""
    if any(im.dtype not in PIXEL_FRAMES for im in images):
        raise ValueError(f"an image's pixels must be one of {sorted(PIXEL_FRAMES)}")
    for dtype, frame in (("float32", pixel_values), ("uint8", pixel_bytes)):
        if sum(im.size for im in images if im.dtype == dtype) != (0 if frame is None else len(frame)):
            raise ValueError(f"{dtype} pixel values do not match the images' shapes")
    for im in images:
        if im.start < 0 or im.tokens < 1 or (prompt_len is not None and im.start + im.tokens > prompt_len):
            raise ValueError("an image's placeholders lie outside the prompt")


def image_pixels(images: list[ImageInput], pixel_values: Any, pixel_bytes: Any) -> list[Any]:
    """Each image's flat pixels, sliced from the frame its dtype names (frames as check_images accepts them)."""
    frames = {"float32": pixel_values, "uint8": pixel_bytes}
    at, out = dict.fromkeys(frames, 0), []
    for im in images:
        out.append(frames[im.dtype][at[im.dtype] : at[im.dtype] + im.size])
        at[im.dtype] += im.size
    return out


def pixel_frames(pixels: list[Any]) -> dict[str, Any]:
    """The message fields that carry images' flat pixels (numpy arrays, in image order): uint8 ones in
    `pixel_bytes`, the others in `pixel_values` as float32; None where none goes."""
    raw = [p for p in pixels if p.dtype == np.uint8]
    values = [p for p in pixels if p.dtype != np.uint8]
    return {
        "pixel_values": np.concatenate(values).astype(np.float32, copy=False) if values else None,
        "pixel_bytes": np.concatenate(raw) if raw else None,
    }


class TokenizedRequest(Message, tag="tokenized", kw_only=True):
    """A validated, tokenized request (tokenizer → admit → router → replica in).

    The router forwards the same message to the chosen scheduler with `replica` and
    `detokenizer` filled in.
    """

    FRAMES = (("input_ids", "<i4"), ("pixel_values", "<f4"), ("pixel_bytes", "u1"))

    def check(self) -> None:
        if len(self.input_ids) == 0 or self.max_new_tokens < 1:
            raise ValueError("a tokenized request needs input ids and max_new_tokens >= 1")
        check_images(self.images, self.pixel_values, len(self.input_ids), self.pixel_bytes)

    request_id: str
    ingress: int
    input_ids: Any = None  # np.ndarray[int32], the prompt after truncation (raw frame)
    sampling: SamplingParams
    max_new_tokens: int  # resolved: never None here
    stop: list[str] = []  # stop sequences, matched by the detokenizer
    seed: int | None = None  # seed to report in details (None when greedy)
    received_at: float = 0.0
    traceparent: str | None = None  # W3C trace context, carried on from GenerateRequest
    replica: int = -1  # set by the router
    detokenizer: int = -1  # set by the router: the detokenizer shard that streams this request
    grammar: str = ""  # llguidance grammar text, compiled once by the tokenizer ("": unconstrained)
    grammar_kind: str = ""  # json | regex | gbnf | lark | tools | tools_auto (a metrics label)
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model), checked by the tokenizer
    images: list[ImageInput] = []  # a vision model's images, in prompt order (their pixels: the two frames below)
    pixel_values: Any = None  # np.ndarray[float32], the float32 images' pixels flattened and concatenated (raw frame)
    group: str = ""  # GenerateRequest.group: siblings whose prompt KV blocks the scheduler shares
    model: str = ""  # GenerateRequest.model: the router places it only on replicas of that model
    pixel_bytes: Any = None  # np.ndarray[uint8], the uint8 images' pixels flattened and concatenated (raw frame)


# --------------------------------------------------------------------------------------------
# Event bus (router XSUB/XPUB proxy), by topic; see libs.protocol.topics


class Hello(Message, tag="hello", kw_only=True):
    """Published by a subscriber on its own topic: hearing it back proves the subscription is live."""

    nonce: str


class Accepted(Message, tag="accepted", kw_only=True):
    """The router placed a request (router → out.<ingress>)."""

    request_id: str
    replica: int
    input_length: int
    max_new_tokens: int = 0  # the resolved max_new_tokens, for tgi_request_max_new_tokens (0: unknown)


class RequestError(Message, tag="error", kw_only=True):
    """A request failed; this ends it (any service → out.<ingress>). TGI's error shape."""

    request_id: str
    message: str  # TGI's `error`, e.g. "Input validation error: `inputs` cannot be empty"
    error_type: str  # TGI's `error_type`: validation, overloaded, generation, …


# How many prompt ids a StreamOpen carries: the detokenizer's left context, as TGI's (prefix_offset =
# prompt_length - 5); it lets decoders that strip or merge spaces at the start of a text (Metaspace, WordPiece)
# decode the first tokens correctly (services/detokenizer/incremental.py).
PROMPT_TAIL = 5


class StreamOpen(msgspec.Struct, kw_only=True, array_like=True):
    """What a detokenizer must know about a request before its first token row."""

    request_id: str
    ingress: int
    replica: int
    input_length: int
    prompt_tail: list[int]  # the last ≤ PROMPT_TAIL prompt ids: left context for clean incremental decoding
    stop: list[str] = []
    seed: int | None = None
    # decoder_input_details: every prompt id and its logprob (NaN for the first), for TGI's `prefill`
    prompt_ids: list[int] = []
    prompt_logprobs: list[float] = []
    traceparent: str | None = None  # W3C trace context of the scheduler span the detokenizer's span continues
    # with prompt_ids: per prompt position, the raw argmax token before it and its logprob (-1 / NaN for the first)
    prompt_greedy_ids: list[int] = []
    prompt_greedy_logprobs: list[float] = []
    min_tokens: int = 0  # stop sequences are not honoured before this many tokens (vLLM's min_tokens)


# finish codes in TokenBatch.finish
FINISH_NONE, FINISH_LENGTH, FINISH_EOS, FINISH_ABORTED, FINISH_ERROR = 0, 1, 2, 3, 4
FINISH_NAMES = {FINISH_LENGTH: "length", FINISH_EOS: "eos_token", FINISH_ABORTED: "aborted"}


class TokenBatch(Message, tag="tokens", kw_only=True):
    """Sampled tokens for one detokenizer shard, one row per request and step (scheduler → tok.<k>).

    `opens` introduces requests whose first row is in this batch. A row's offset is the token's
    index in the request's output (0-based), so a receiver sees duplicates and gaps.
    """

    FRAMES = (
        ("offsets", "<u4"),
        ("token_ids", "<i4"),
        ("logprobs", "<f4"),
        ("finish", "u1"),  # FINISH_* per row
        ("top_counts", "<i4"),  # per row: alternatives that follow in top_ids/top_logprobs (or empty: none)
        ("top_ids", "<i4"),
        ("top_logprobs", "<f4"),
    )

    replica: int
    request_ids: list[str]
    opens: list[StreamOpen] = []
    # a resync (docs/recovery.md): request ids whose detokenizer state is dropped first; the batch then holds their
    # StreamOpen and every token from offset 0, and the detokenizer re-emits every row (http dedupes by index)
    reset: list[str] = []
    offsets: Any = None
    token_ids: Any = None
    logprobs: Any = None
    finish: Any = None
    top_counts: Any = None
    top_ids: Any = None
    top_logprobs: Any = None

    def check(self) -> None:
        n = len(self.request_ids)
        if not len(self.offsets) == len(self.token_ids) == len(self.logprobs) == len(self.finish) == n:
            raise ValueError("token batch rows of unequal length")
        if len(self.top_counts) not in (0, n):  # empty: no row has alternatives
            raise ValueError("token batch top_counts of the wrong length")
        if int(self.top_counts.sum()) != len(self.top_ids) or len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("token batch alternatives do not match top_counts")


class TokenText(msgspec.Struct, kw_only=True, array_like=True):
    """A token with its text: a top-n alternative or a prefill token (TGI's `Token`/`PrefillToken`)."""

    id: int
    text: str  # the token alone, decoded without cleanup, special tokens kept (TGI)
    logprob: float | None  # None for the first prompt token
    special: bool = False


class FinalInfo(msgspec.Struct, kw_only=True, array_like=True):
    """The end of a request's stream, as TGI reports it."""

    generated_text: str
    finish_reason: str  # length | eos_token | stop_sequence | aborted
    generated_tokens: int
    input_length: int
    seed: int | None = None
    prefill: list[TokenText] = []  # with decoder_input_details: the prompt tokens
    # with decoder_input_details: per prompt token, the greedy token at its position (None for the first)
    prefill_greedy: list[TokenText | None] = []


class TextRow(msgspec.Struct, kw_only=True, array_like=True):
    """One generated token with its text (TGI's `Token`), and the final info on the last row."""

    request_id: str
    index: int  # 1-based, as TGI's stream `index`
    token_id: int
    text: str  # incremental text of this token (may be "" while bytes are held back)
    logprob: float
    special: bool
    final: FinalInfo | None = None
    top_tokens: list[TokenText] = []  # with top_n_tokens: the alternatives, best first


class TextBatch(Message, tag="text", kw_only=True):
    """Detokenized rows for the requests of one http process (detokenizer → out.<ingress>)."""

    rows: list[TextRow]


class TokenizeResult(Message, tag="tokenized_text", kw_only=True):
    """The answer to a `mode="tokenize"` request (tokenizer → out.<ingress>); ends the request.

    TGI's /tokenize shape per token: id, text, start, stop (character offsets into `text`).
    """

    FRAMES = (("ids", "<i4"), ("starts", "<u4"), ("stops", "<u4"))

    request_id: str
    text: str  # what was tokenized: the inputs, or the rendered chat template
    ids: Any = None
    starts: Any = None
    stops: Any = None

    def check(self) -> None:
        if not len(self.ids) == len(self.starts) == len(self.stops):
            raise ValueError("tokenize rows of unequal length")


class Abort(Message, tag="abort", kw_only=True):
    """Stop a request: its client went away (http → ctl.<replica>). Idempotent."""

    request_id: str


class StopHit(Message, tag="stop_hit", kw_only=True):
    """A stop sequence matched; the scheduler should finish the request (detokenizer → ctl.<replica>)."""

    request_id: str
    generated_tokens: int


class Resync(Message, tag="resync", kw_only=True):
    """A stream stalled or has a gap (http or a detokenizer → ctl.<replica>); docs/recovery.md.

    The scheduler answers with its StreamOpen and every token so far (TokenBatch.reset) when it holds the
    request's tokens, re-sends Accepted when the request still waits, or answers Unknown."""

    request_id: str
    ingress: int  # where to send Unknown / Accepted (-1 from a detokenizer: the scheduler knows it)
    # http: the rows it delivered (a live request whose published rows all arrived is slow, not lost: Accepted
    # again instead of a replay); -1: unknown (a detokenizer), replay
    delivered: int = -1


class Unknown(Message, tag="unknown", kw_only=True):
    """The scheduler does not hold this request (it restarted): http resubmits it (scheduler → out.<ingress>)."""

    request_id: str


class ChatFormatNote(msgspec.Struct, kw_only=True):
    """A tokenizer's chat format, in its heartbeat: what an http process needs to read its model's chat answers
    (tool calls, reasoning) as that tokenizer renders the prompts, when the model is not the http process's own. The
    template text, not only the parsers' names: whether a prompt leaves the reasoning open depends on each request's
    template variables, so http renders the template's probe itself (services.http.chat_formats)."""

    templates: dict[str, str]  # name → Jinja source ("default", "tool_use"), --chat-template's when given
    bos_token: str | None = None
    eos_token: str | None = None
    tool_call_parser: str = ""  # the model's --tool-call-parser ("": chosen from the template)
    reasoning_parser: str = ""  # its --reasoning-parser ("": chosen from the template)


class Heartbeat(Message, tag="hb", kw_only=True):
    """Liveness and load of one process, once a second (every process → hb.<role>.<n>)."""

    role: str
    index: int
    pid: int
    ready: bool = True  # False while starting (e.g. a scheduler whose shards are not ready)
    queue: int = 0  # requests waiting
    running: int = 0  # requests in the running batch
    free_blocks: int = 0
    total_blocks: int = 0
    counters: dict[str, int] = {}  # monotonic counters of the process (steps, tokens, …)
    # the process's own Prometheus registry in text exposition format; /metrics merges them
    metrics: str = ""
    leaving: bool = False  # the last heartbeat of a process stopping cleanly: count it gone at once
    # this process's run: a random id fixed at its start ("": unknown). Two live runs claiming one role and index
    # are a misconfiguration: the later one is refused (libs/runtime/liveness.py) and exits
    instance: str = ""
    # a scheduler's announcement, so that a replica joins the router by starting: the address its intake PULL is
    # bound on (as the router connects to it), its model, adapters and capacity ("" / 0: not a scheduler)
    address: str = ""
    model: str = ""  # the model it serves (--model-id): schedulers, tokenizers, detokenizers and the router say it
    adapters: list[str] = []
    max_batch: int = 0
    draining: bool = False  # a replica finishing its streams before it stops: no new request is placed on it
    chat_format: ChatFormatNote | None = None  # a tokenizer's: its model's chat format (None: not announced)
    # a tokenizer's: the requests it still works on (its image lane), which http's watchdog hears as alive
    holding: list[str] = []


ANY_MESSAGE = (
    GenerateRequest
    | TokenizedRequest
    | Hello
    | Accepted
    | RequestError
    | TokenBatch
    | TextBatch
    | TokenizeResult
    | Abort
    | StopHit
    | Resync
    | Unknown
    | Heartbeat
)
