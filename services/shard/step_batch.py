"""What a shard step is made of: each sequence's state as the runner keeps it, and one plan's rows laid out for a
packed forward (services/shard/model_runner.py builds them; sampling and verification read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from libs.protocol.params import SamplingParams
from services.shard.attention.paged import PagedBatch


class History:
    """A sequence's fed token ids, in a buffer that doubles (amortised O(1) appends, one contiguous view)."""

    def __init__(self) -> None:
        self._buf = np.zeros(64, dtype=np.int64)
        self._n = 0

    def extend(self, tokens: np.ndarray) -> None:
        need = self._n + len(tokens)
        if need > len(self._buf):
            self._buf = np.resize(self._buf, max(need, 2 * len(self._buf)))
        self._buf[self._n : need] = tokens
        self._n = need

    def view(self) -> np.ndarray:
        return self._buf[: self._n]

    def drop(self, n: int) -> None:
        """Forget the last `n` tokens (drafts that were rejected)."""
        self._n -= n


@dataclass
class SequenceState:
    sampling: SamplingParams
    generator: torch.Generator
    blocks: list[int] = field(default_factory=list)
    # every fed token (prompt chunks, then each decode's fed token), only for penalties and the watermark
    history: History | None = None
    prefilling: bool = True  # until its first sampled row: only prefill rows report prompt logprobs
    # prompt logprobs: the log-softmax at the previous chunk's last position (scores this chunk's first token)
    carried: torch.Tensor | None = None
    adapter: str | None = None  # the LoRA adapter its rows run with (None: the base model)


@dataclass
class Batch:
    """One plan's rows laid out for a packed forward (what `_prepare` builds for forward, sample and pack)."""

    seqs: np.ndarray  # per row: sequence handle
    states: list[SequenceState]  # per row
    cu: np.ndarray  # row bounds in the packed tokens: row i is [cu[i], cu[i + 1])
    sample_rows: np.ndarray  # per row: whether it yields a token (bool)
    drafts: np.ndarray | None  # per row: how many of its fed tokens are drafts (None: no row has any)
    draw_positions: np.ndarray  # per pick (one per sampled row, 1 + drafts with drafts): the position it draws
    fed_ids: np.ndarray  # the fed token ids of all rows, concatenated
    input_ids: torch.Tensor  # the same, on the device
    position_ids: torch.Tensor
    paged: PagedBatch
    keep: torch.Tensor  # positions that reach the LM head
    prompt_rows: list[int]  # rows that report prompt logprobs
    prompt_at: list[int]  # where each prompt row's run of logits starts among the kept ones
    sample_at: np.ndarray  # where each sampled row's logits are among the kept ones
    keys: list[int | None] | None = None  # per pick: its handle when it has a grammar (None: no row has)
    chains: list | None = None  # per pick of a drafted row with a grammar: (its row's drafts, j) (expand_picks)
    images: object = None  # a vision model's step: the placeholders' embeddings (vision/cache.py StepImages)

    def sampled_states(self) -> list[SequenceState]:
        return self.states if self.sample_rows.all() else [st for st, s in zip(self.states, self.sample_rows) if s]

    @cached_property
    def drafted(self) -> list[np.ndarray]:
        """Per sampled row, the drafts it fed (after its last token); read by sampling and by acceptance."""
        ends, drafts = self.cu[1:][self.sample_rows].tolist(), self.drafts[self.sample_rows].tolist()
        return [self.fed_ids[end - d : end] for end, d in zip(ends, drafts)]
