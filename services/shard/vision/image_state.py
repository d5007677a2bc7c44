"""The image state of a vision model's live sequences on the shard, and what a step takes from it: the encoder cache
(each sequence's images still to feed, and the encoder outputs a prefill is in the middle of), the M-RoPE layouts
of the sequences that hold images (Qwen2-VL), and the bidirectional spans of the images a prefill chunk feeds
(Gemma 3). The runner opens a plan's new sequences here, drops finished ones, and asks each step for its
placeholder embeddings and rotary positions."""

from __future__ import annotations

import numpy as np
import torch

from libs.protocol.messages import image_pixels
from libs.protocol.step_messages import StepPlan
from services.shard.attention.paged import PagedBatch
from services.shard.vision import encoder as vision_encoder
from services.shard.vision import gemma3 as vision_gemma3
from services.shard.vision import loader as vision_loader
from services.shard.vision.cache import EncoderCache, StepImages
from services.shard.vision.mrope import MRopePositions
from services.shard.vision.pixels import PixelFinisher


class ImageState:
    def __init__(self, model: torch.nn.Module, model_dir: str | None = None) -> None:
        self.cache = EncoderCache(vision_encoder.for_model(model))
        self.pixels = PixelFinisher(model_dir)  # images sent as bytes: their processor's rescale and normalize
        self.encoder = self.cache.encoder
        # the image layouts of an M-RoPE model's sequences (None: 1-D positions)
        self.mrope: MRopePositions | None = MRopePositions() if vision_loader.uses_mrope(model) else None
        self.both_ways = vision_loader.attends_images_both_ways(model)

    def open(self, plan: StepPlan) -> dict[int, str]:
        """The new sequences' images, their pixels sliced from the plan's frames in order (bytes finished into
        the processor's values). Returns the sequences refused, with why: an image the model's encoder cannot read
        as sent. Such a sequence holds no image here; the step still feeds its row (as text), and the scheduler
        fails that request alone on the reason."""
        images = [im for new in plan.new for im in new.images]
        pixels = iter(image_pixels(images, plan.pixel_values, plan.pixel_bytes))
        refused = {}
        for new in plan.new:
            flat = [next(pixels) for _ in new.images]
            why = next(filter(None, (self.pixels.refuses(im) or self.encoder.refuses(im) for im in new.images)), None)
            if why is not None:
                refused[new.seq] = f"image: {why}"
            elif new.images:
                self.cache.open(new.seq, new.images, [self.pixels.values(im, px) for im, px in zip(new.images, flat)])
            if self.mrope is not None:
                self.mrope.open(new.seq, new.cached_images + new.images)
        return refused

    def drop(self, seq: int) -> None:
        self.cache.drop(seq)
        if self.mrope is not None:
            self.mrope.drop(seq)

    def clear(self) -> None:
        self.cache.clear()
        if self.mrope is not None:
            self.mrope.clear()

    @property
    def shifts_positions(self) -> bool:
        """Whether a live sequence's positions are not its tokens' indices (an M-RoPE model holding images)."""
        return self.mrope is not None and bool(self.mrope.layouts)

    def step(
        self,
        seqs: np.ndarray,
        context_lens: np.ndarray,
        num_tokens: np.ndarray,
        cu: np.ndarray,
        positions: np.ndarray,
        paged: PagedBatch,
    ) -> tuple[StepImages | None, np.ndarray]:
        """The step's placeholder embeddings (None: it feeds none) and its rotary positions: the tokens' own, or an
        M-RoPE model's (shifted past images; [3, T] in an image). Sets `paged`'s bidirectional spans where the
        model's images attend both ways."""
        if self.both_ways:
            paged.spans = vision_gemma3.image_spans(self.cache, seqs, context_lens, num_tokens)
            if paged.spans:  # the torch ops carry the spans (on any device; the Triton kernel is causal only)
                paged.backend = "torch"
        images = self.cache.step(seqs, context_lens, num_tokens, cu)
        rope_positions = positions if self.mrope is None else self.mrope.positions(seqs, cu, positions)
        return images, rope_positions
