"""Gemma 3's vision: a SigLIP tower and a projector that average-pools its patches to a fixed count of image tokens
(transformers' get_image_features), and its prefill mask: the tokens of one image attend to each other both ways
(transformers' token_type_ids blocks), given to the paged attention as bidirectional spans
(services/shard/attention/bidirectional.py). The language model is Gemma 3's text model, walked as any."""

from __future__ import annotations

import time

import numpy as np
import torch

from services.shard.vision.cache import EncoderCache
from services.shard.vision.encoder import VisionEncoder

FAMILIES = {"gemma3"}


class Gemma3VisionEncoder(VisionEncoder):
    @torch.inference_mode()
    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's pooled embeddings, [mm_tokens_per_image, hidden]; images of one shape run as one batch."""
        started = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(pixels)
        by_shape: dict[tuple, list[int]] = {}
        for i, px in enumerate(pixels):
            by_shape.setdefault(tuple(px.shape), []).append(i)
        for idx in by_shape.values():
            batch = torch.stack([pixels[i] for i in idx]).to(self.device, self.dtype)
            feats = self.model.model.get_image_features(pixel_values=batch, return_dict=True).pooler_output
            for i, f in zip(idx, feats):
                out[i] = f
        self.images += len(pixels)
        self.seconds += time.perf_counter() - started
        return out


def image_spans(cache: EncoderCache, seqs: np.ndarray, context_lens: np.ndarray, num_tokens: np.ndarray) -> dict:
    """Row -> [n, 2] positions [start, end) of the images whose placeholders this step feeds (read before the
    cache's `step`, which forgets images once fed); an image already wholly in the cache needs none."""
    spans = {}
    for i, seq in enumerate(seqs.tolist()):
        lo, hi = int(context_lens[i]), int(context_lens[i] + num_tokens[i])
        held = [(p.image.start, p.end) for p in cache.pending.get(seq, ()) if p.image.start < hi and p.end > lo]
        if held:
            spans[i] = np.array(held, dtype=np.int64)
    return spans
