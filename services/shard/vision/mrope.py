"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL) of the sequences that hold images, placed as transformers'
`get_rope_index` places a prompt's tokens.

An image's tokens take three rotary positions (temporal, height, width): the image's first position plus the token's
place in the image's token grid. The text after an image continues from that first position plus max(h, w), so
every token outside an image has three equal positions: its index in the sequence shifted by max(h, w) - t·h·w for
each image before it (generated tokens: by all of them, transformers' `rope_deltas`). A step that feeds no image
token therefore keeps one position per token, shifted; only a step that feeds image tokens takes the [3, T] form
(equal rows for its other tokens). The KV slots stay at the tokens' indices: only the rotary reads these.
"""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import ImageInput
from services.shard.vision.qwen2_vl import token_grid


class Layout:
    """One sequence's images, in prompt order: where each one's tokens lie and their grid."""

    def __init__(self, images: list[ImageInput]) -> None:
        images = sorted(images, key=lambda im: im.start)
        self.starts = np.array([im.start for im in images], np.int64)
        self.grids = [token_grid(im) for im in images]
        self.ends = self.starts + np.array([t * h * w for t, h, w in self.grids], np.int64)
        moved = [max(h, w) - t * h * w for t, h, w in self.grids]  # how far each image moves the text after it
        self.shift_after = np.concatenate(([0], np.cumsum(moved))).astype(np.int64)  # after the first k images

    def shifted(self, index: np.ndarray) -> np.ndarray:
        """The position of a text token at each `index` (an image's token: its image's first position + its
        place in the image's tokens)."""
        return index + self.shift_after[np.searchsorted(self.ends, index, side="right")]

    def images_within(self, lo: int, hi: int) -> np.ndarray:
        """The images with tokens among indices [lo, hi)."""
        return np.flatnonzero((self.starts < hi) & (self.ends > lo))

    def fill(self, out: np.ndarray, lo: int, hi: int) -> None:
        """Write the three positions of the image tokens among indices [lo, hi) into `out` ([3, hi - lo], its
        other tokens' already there)."""
        for j in self.images_within(lo, hi).tolist():
            a, b = max(lo, int(self.starts[j])), min(hi, int(self.ends[j]))
            t, h, w = self.grids[j]
            first = int(self.starts[j] + self.shift_after[j])
            q = np.arange(a - int(self.starts[j]), b - int(self.starts[j]))  # places in the image's tokens
            out[:, a - lo : b - lo] = first + np.stack((q // (h * w), q // w % h, q % w))


class MRopePositions:
    """Each live sequence's image layout (those with images only) and the step's rotary positions from them."""

    def __init__(self) -> None:
        self.layouts: dict[int, Layout] = {}

    def open(self, seq: int, images: list[ImageInput]) -> None:
        """A new sequence's images: those it feeds and those in its cached prefix, all of them."""
        if images:
            self.layouts[seq] = Layout(images)

    def drop(self, seq: int) -> None:
        self.layouts.pop(seq, None)

    def clear(self) -> None:
        self.layouts.clear()

    def positions(self, seqs: np.ndarray, cu: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The step's rotary positions: `positions` itself (the tokens' indices) when no row holds images, else
        shifted [T], or [3, T] when the step feeds image tokens."""
        rows = [(i, self.layouts[s]) for i, s in enumerate(seqs.tolist()) if s in self.layouts] if self.layouts else []
        if not rows:
            return positions
        out = positions.copy()
        for i, layout in rows:
            out[cu[i] : cu[i + 1]] = layout.shifted(positions[cu[i] : cu[i + 1]])
        three = None
        for i, layout in rows:
            a, b = int(cu[i]), int(cu[i + 1])
            lo, hi = int(positions[a]), int(positions[b - 1]) + 1
            if len(layout.images_within(lo, hi)):
                if three is None:
                    three = np.repeat(out[None], 3, axis=0)
                layout.fill(three[:, a:b], lo, hi)
        return out if three is None else three
