"""The messages between a replica's scheduler and its shards: step plans, their results, and a shard's ready call
(the request and stream messages are in `libs.protocol.messages`, LoRA's in `libs.protocol.lora`)."""

from __future__ import annotations

from typing import Any

import msgspec

from libs.protocol.message_base import Message
from libs.protocol.messages import ImageInput, check_images
from libs.protocol.params import SamplingParams

# --------------------------------------------------------------------------------------------
# Scheduler ↔ shards (replica plan PUB / results PULL)


class NewSequence(msgspec.Struct, array_like=True):
    """A sequence the shard has not seen: its key in the plan and how to sample it."""

    seq: int  # the scheduler's small integer handle for the request
    sampling: SamplingParams
    # token ids already in the KV cache when the sequence starts (a prefix-cache hit, or a recompute after
    # preemption), sent only for sequences whose penalties/watermark need the whole token history
    prefix_ids: list[int] = []
    adapter: str | None = None  # the LoRA adapter its rows run with (None: the base model)
    grammar: str = ""  # llguidance grammar text: the shard builds the sequence's matcher ("": unconstrained)
    grammar_ids: list[int] = []  # the tokens it generated already (a recompute): replayed into the matcher
    # the images whose placeholders it still has to feed (not in its cached prefix); pixels in StepPlan's frames
    images: list[ImageInput] = []
    # the images wholly in its cached prefix (no pixels: never encoded again), for models whose positions after an
    # image depend on its layout (M-RoPE: services/shard/vision/mrope.py)
    cached_images: list[ImageInput] = []


class StepPlan(Message, tag="plan", kw_only=True):
    """One model step (scheduler → every shard of a replica).

    A plan is a diff: `new` introduces sequences, `blocks` appends KV blocks to a sequence's block
    table, `finished` lets the shard drop per-sequence state. The rows then say, per sequence,
    which tokens to feed at which position. Step 0 with no rows is the subscription probe.
    """

    FRAMES = (
        ("seqs", "<i4"),  # per row: sequence handle
        ("num_tokens", "<i4"),  # per row: tokens fed this step (prompt length, or 1 for a decode)
        ("context_lens", "<i4"),  # per row: tokens already in the KV cache before this step
        ("token_ids", "<i4"),  # the fed tokens of all rows, concatenated
        ("sample", "u1"),  # per row: 1 if the row's last position yields a token this step
        # per row: how many of its fed tokens are drafts to verify (speculative decoding; a drafted row feeds
        # [its last token, d1..dk] and yields 1..k+1 tokens), or empty when no row has drafts
        ("drafts", "<i4"),
        ("pixel_values", "<f4"),  # the new sequences' float32 images' pixels, in order (NewSequence.images)
        ("pixel_bytes", "u1"),  # their uint8 images' pixels, in order (ImageInput.dtype)
    )

    step: int
    new: list[NewSequence] = []
    blocks: dict[int, list[int]] = {}  # seq → block ids appended to its table, in order
    finished: list[int] = []  # seqs whose state the shard can drop
    seqs: Any = None
    num_tokens: Any = None
    context_lens: Any = None
    token_ids: Any = None
    sample: Any = None
    drafts: Any = None
    # seq → how many blocks of its table it keeps: the scheduler freed the ones past (rejected drafts' KV);
    # applied before `blocks` appends
    trim: dict[int, int] = {}
    pixel_values: Any = None
    pixel_bytes: Any = None

    def check(self) -> None:
        check_images([im for new in self.new for im in new.images], self.pixel_values, pixel_bytes=self.pixel_bytes)
        n = len(self.seqs)
        if not len(self.num_tokens) == len(self.context_lens) == len(self.sample) == n:
            raise ValueError("plan rows of unequal length")
        if int(self.num_tokens.sum()) != len(self.token_ids):
            raise ValueError("plan token ids do not match num_tokens")
        drafts = () if self.drafts is None else self.drafts  # None: built in process without drafts
        if len(drafts) not in (0, n):
            raise ValueError("plan drafts of the wrong length")
        if len(drafts) and ((drafts < 0).any() or (drafts >= self.num_tokens).any()):
            raise ValueError("plan drafts must leave a row's first fed token undrafted")


class StepResult(Message, tag="result", kw_only=True):
    """The tokens sampled in one step (shard rank 0 → scheduler).

    A sampled row yields one token, or with drafts 1..k+1 (`token_counts`); the per-token frames list every
    token of every row in row order, and the scheduler takes them as consecutive outputs of the row."""

    FRAMES = (
        ("seqs", "<i4"),  # per sampled row: sequence handle
        ("token_counts", "<i4"),  # per sampled row: tokens it yields (or empty: one each, no row had drafts)
        ("token_ids", "<i4"),  # per token: the chosen token
        ("logprobs", "<f4"),  # per token: its logprob after the warpers (TGI)
        ("top_counts", "<i4"),  # per token: how many alternatives follow (or empty: none at all)
        ("top_ids", "<i4"),  # alternatives of all rows, concatenated, best first
        ("top_logprobs", "<f4"),  # their logprobs (same distribution as `logprobs`)
        ("prompt_seqs", "<i4"),  # per fed row with prompt_logprobs: sequence handle
        ("prompt_counts", "<i4"),  # per such row: tokens fed this step (a prefill chunk)
        ("prompt_logprobs", "<f4"),  # logprob of each fed token given the ones before it (raw logits;
        #                              NaN for the very first prompt token), concatenated
        ("prompt_greedy_ids", "<i4"),  # per fed token: the raw argmax before it (-1 for the first), or empty
        ("prompt_greedy_logprobs", "<f4"),  # its logprob (NaN for the first), or empty
    )

    step: int
    rank: int = 0
    forward_s: float = 0.0  # seconds the shard spent in the forward pass and sampling
    error: str | None = None  # set when the step failed; the scheduler fails its requests
    errors: dict[int, str] = {}  # seq → what failed ("grammar: …", "image: …"): that request alone fails
    seqs: Any = None
    token_counts: Any = None
    token_ids: Any = None
    logprobs: Any = None
    top_counts: Any = None
    top_ids: Any = None
    top_logprobs: Any = None
    prompt_seqs: Any = None
    prompt_counts: Any = None
    prompt_logprobs: Any = None
    prompt_greedy_ids: Any = None
    prompt_greedy_logprobs: Any = None
    encode_s: float = 0.0  # of forward_s: seconds in the vision encoder (a step that encoded images)

    def check(self) -> None:
        counts = () if self.token_counts is None else self.token_counts
        tokens = int(counts.sum()) if len(counts) else len(self.seqs)
        if len(counts) not in (0, len(self.seqs)) or (len(counts) and (counts < 1).any()):
            raise ValueError("result token_counts must give each row at least one token")
        if not tokens == len(self.token_ids) == len(self.logprobs):
            raise ValueError("result rows of unequal length")
        if len(self.top_counts) not in (0, tokens):  # empty: no row asked for alternatives
            raise ValueError("result top_counts of the wrong length")
        if int(self.top_counts.sum()) != len(self.top_ids) or len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("result alternatives do not match top_counts")
        if len(self.prompt_seqs) != len(self.prompt_counts) or int(self.prompt_counts.sum()) != len(
            self.prompt_logprobs
        ):
            raise ValueError("result prompt logprobs do not match prompt_counts")
        if len(self.prompt_greedy_ids) not in (0, len(self.prompt_logprobs)) or len(self.prompt_greedy_ids) != len(
            self.prompt_greedy_logprobs
        ):
            raise ValueError("result prompt greedy tokens do not match prompt_logprobs")


class ShardReady(Message, tag="shard_ready", kw_only=True):
    """A shard has loaded its model and wants plans (shard → scheduler, repeated until a plan comes)."""

    rank: int
    pid: int
    num_blocks: int


ANY_STEP_MESSAGE = StepPlan | StepResult | ShardReady
