"""The shard's image state between steps: each sequence's images still to feed, with their pixels, and the encoder
outputs of the images a prefill is in the middle of, merged into the step's input embeddings at the placeholder
positions.

An image is encoded when a step first feeds one of its placeholders, once for every sequence that shows the same
image (keyed by content digest), and its output is dropped as soon as no sequence's prefill still needs it: a
chunked prefill keeps it between chunks, a finished or preempted one does not. At most `max_images` outputs are
held; past that the least recently used goes, to be encoded again from its pixels if a chunk still needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from libs.protocol.messages import ImageInput
from services.shard.vision.encoder import VisionEncoder


@dataclass
class _Pending:
    image: ImageInput
    pixels: torch.Tensor  # float32 on the host: [*image.shape], or as pixels.py finished them from bytes

    @property
    def end(self) -> int:
        return self.image.start + self.image.tokens


@dataclass
class StepImages:
    """Where one step's fed placeholders take their embeddings from: packed positions and the rows of the outputs."""

    positions: torch.Tensor  # [n] indices into the packed step
    rows: torch.Tensor  # [n, hidden] the embeddings that replace those positions'


class EncoderCache:
    def __init__(self, encoder: VisionEncoder, max_images: int = 32) -> None:
        self.encoder = encoder
        self.max_images = max_images
        self.pending: dict[int, list[_Pending]] = {}  # seq → its images whose placeholders are not all fed
        self.outputs: OrderedDict[str, torch.Tensor] = OrderedDict()  # digest → encoder output, LRU first

    def open(self, seq: int, images: list[ImageInput], pixels: list[np.ndarray]) -> None:
        """A new sequence's images and each one's float32 pixels (flat: shaped as the image says; shaped: kept)."""
        held = [
            _Pending(im, torch.from_numpy(np.array(px, np.float32)).reshape(im.shape if np.ndim(px) == 1 else px.shape))
            for im, px in zip(images, pixels)
        ]
        if held:
            self.pending[seq] = held

    def drop(self, seq: int) -> None:
        self.pending.pop(seq, None)
        self._release()

    def clear(self) -> None:
        self.pending.clear()
        self.outputs.clear()

    def step(self, seqs: np.ndarray, context_lens: np.ndarray, num_tokens: np.ndarray, cu: np.ndarray):
        """The step's placeholder embeddings (None when it feeds none); images whose placeholders are all fed
        after it are no longer pending."""
        wanted = []  # (packed start, image offset, count, pending)
        for i, seq in enumerate(seqs.tolist()):
            held = self.pending.get(seq)
            if not held:
                continue
            lo, hi = int(context_lens[i]), int(context_lens[i] + num_tokens[i])
            for p in held:
                a, b = max(lo, p.image.start), min(hi, p.end)
                if a < b:
                    wanted.append((int(cu[i]) + a - lo, a - p.image.start, b - a, p))
            left = [p for p in held if p.end > hi]
            if left:
                self.pending[seq] = left
            else:
                del self.pending[seq]
        if not wanted:
            return None
        self._encode_missing([w[3] for w in wanted])
        positions, rows = [], []
        for at, offset, count, p in wanted:
            out = self.outputs[p.image.digest]
            self.outputs.move_to_end(p.image.digest)
            if out.shape[0] != p.image.tokens:
                raise ValueError(f"image has {p.image.tokens} placeholders but the encoder made {out.shape[0]} rows")
            positions.append(torch.arange(at, at + count))
            rows.append(out[offset : offset + count])
        self._release()
        device = rows[0].device
        return StepImages(torch.cat(positions).to(device), torch.cat(rows))

    def _encode_missing(self, needed: list[_Pending]) -> None:
        missing: dict[str, _Pending] = {}
        for p in needed:
            if p.image.digest not in self.outputs:
                missing.setdefault(p.image.digest, p)
        if missing:
            pending = list(missing.values())
            self.outputs.update(
                zip(missing, self.encoder.encode([p.pixels for p in pending], [p.image for p in pending]))
            )

    def _release(self) -> None:
        """Drop the outputs no pending image needs, then the least recently used past the bound."""
        needed = {p.image.digest for held in self.pending.values() for p in held}
        for digest in [d for d in self.outputs if d not in needed]:
            del self.outputs[digest]
        while len(self.outputs) > self.max_images:
            self.outputs.popitem(last=False)


def merge(embeds: torch.Tensor, images: StepImages) -> torch.Tensor:
    """The step's input embeddings with the placeholders' replaced by their images' rows ([T, hidden], in place)."""
    embeds.index_copy_(0, images.positions, images.rows.to(embeds.dtype))
    return embeds
