"""Bidirectional spans in the paged attention: a prefill row's span (an image block) is seen both ways, as
transformers' gemma3 mask ORs same-image onto causal and sliding-window masks; other rows stay causal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.shard.attention import paged
from tests.services.shard.attention.test_paged import _batch

HEADS, SCALE = 4, 0.3


def _reference(tokens, k_cache, v_cache, tables, cu, q_lens, ctx_lens, spans, window):
    """Each row alone by eager math over its own keys, with the mask built as masking_utils does for gemma3."""
    d = k_cache.shape[-1]
    out = []
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        blocks = torch.from_numpy(tables[i][tables[i] >= 0])
        k = k_cache.index_select(1, blocks).reshape(2, -1, d)[:, : c + q].repeat_interleave(2, 0)
        v = v_cache.index_select(1, blocks).reshape(2, -1, d)[:, : c + q].repeat_interleave(2, 0)
        qs = tokens[cu[i] : cu[i + 1]].transpose(0, 1)
        qp, kp = (c + torch.arange(q))[:, None], torch.arange(c + q)[None, :]
        visible = kp <= qp
        for start, end in spans.get(i, ()):
            visible |= (qp >= start) & (qp < end) & (kp >= start) & (kp < end)
        if window:  # AND(sliding_window, OR(causal, blockwise)): create_masks_for_vision_model
            visible &= kp > qp - window
        scores = (qs @ k.transpose(1, 2) * SCALE).masked_fill(~visible, float("-inf"))
        out.append((torch.softmax(scores, -1) @ v).transpose(0, 1))
    return torch.cat(out)


def _run(q_lens, ctx_lens, spans, window):
    batch, k_cache, v_cache, tables = _batch(q_lens, ctx_lens)
    batch.spans = {r: np.array(s, dtype=np.int64) for r, s in spans.items()}
    groups, tiled = batch.plan(window, torch.device("cpu"))
    tokens = torch.randn(sum(q_lens), HEADS, k_cache.shape[-1], generator=torch.Generator().manual_seed(1))
    got = paged.attend(tokens, k_cache, v_cache, groups, SCALE, None)
    args = (tokens, k_cache, v_cache, tables, batch.host_cu, q_lens, ctx_lens)
    return got, _reference(*args, spans, window), _reference(*args, {}, window)


@pytest.mark.parametrize("window", [0, 6])
def test_an_image_span_is_seen_both_ways_and_the_rest_stays_causal(window):
    # row 0: a whole prefill with an image at [3, 11); row 1: a chunk after its image [2, 7) (all in the cache);
    # row 2: a decode; row 3: a chunk whose image [12, 20) starts in the cache and ends in it
    q_lens, ctx_lens = [14, 5, 1, 9], [0, 9, 20, 11]
    spans = {0: [[3, 11]], 1: [[2, 7]], 2: [[4, 12]], 3: [[12, 20]]}
    got, want, causal = _run(q_lens, ctx_lens, spans, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the span changed what the image's queries saw (a causal-only mask fails here), and nothing else
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    in_image = torch.zeros(len(got), dtype=torch.bool)
    in_image[cu[0] + 3 : cu[0] + 11] = True
    in_image[cu[3] + 1 : cu[3] + 9] = True
    assert not torch.allclose(got[in_image], causal[in_image], atol=1e-3)
    torch.testing.assert_close(got[~in_image], causal[~in_image], rtol=1e-5, atol=1e-5)


def test_a_sliding_layer_cuts_an_image_wider_than_its_window():
    # the image [0, 12) is wider than the window: its queries see the image's later keys, but no key the window
    # has left behind (the OR of the span comes before the window's AND)
    got, want, causal = _run([16], [0], {0: [[0, 12]]}, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:11], causal[:11], atol=1e-3)
    batch, *_ = _batch([16], [0])
    batch.spans = {0: np.array([[0, 12]], dtype=np.int64)}
    (group,), _ = batch.plan(4, torch.device("cpu"))
    hidden = group.hidden[0, 0, 0]  # [Q, keys]
    assert bool(hidden[11, 0]) and not bool(hidden[0, 11]) and not bool(hidden[11, 8])


def test_a_chunk_that_splits_an_image_is_refused():
    batch, *_ = _batch([6], [0])
    batch.spans = {0: np.array([[2, 10]], dtype=np.int64)}
    with pytest.raises(ValueError, match="split by the step"):
        batch.plan(0, torch.device("cpu"))
