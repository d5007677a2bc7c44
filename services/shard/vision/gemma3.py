"""Gemma 3's vision: a SigLIP tower and a projector that average-pools its patches to a fixed count of image tokens
(transformers' get_image_features), and its prefill mask: the tokens of one image attend to each other both ways
(transformers' token_type_ids blocks), given to the paged attention as bidirectional spans
(services/shard/attention/bidirectional.py). The language model is Gemma 3's text model, walked as any."""

from __future__ import annotations

import numpy as np
import torch

from services.shard.vision.cache import EncoderCache
from services.shard.vision.encoder import VisionEncoder

FAMILIES = {"gemma3"}


class Gemma3VisionEncoder(VisionEncoder):
    def features(self, batch: torch.Tensor, images=None) -> torch.Tensor:
        """Pooled to mm_tokens_per_image per image; Gemma 3 takes no feature layer or select strategy."""
        return self.model.model.get_image_features(pixel_values=batch, return_dict=True).pooler_output


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
