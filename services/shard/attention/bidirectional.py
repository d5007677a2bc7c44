"""Bidirectional spans in prefill: within a span of one row (an image's tokens, for Gemma 3) every query sees every
key, as transformers' gemma3 masks compose: OR(causal, same span) on full-attention layers, AND(window, OR(causal,
same span)) on sliding ones (a span wider than the window is still cut by it; the window only bounds the past, so
a sliding layer gathers no key before its usual first one). Spans are absolute positions [start, end) per row;
everything outside them stays causal, so decode rows are unchanged.

A span must lie whole in the cache once its row's step has written its keys: a chunk that holds some of a span's
queries must also hold the span's end (the scheduler keeps an image's block in one chunk), else a query would miss
keys not written yet; such a step is refused here rather than answered with a causal-only mask."""

from __future__ import annotations

import numpy as np

Spans = dict[int, np.ndarray]  # row index -> [n, 2] int64 (start, end) positions, end exclusive


def check(spans: Spans, ctx: np.ndarray, n_q: np.ndarray) -> None:
    """Refuse a step in which a row's queries fall in a span whose end lies past the row's last new token."""
    for row, s in spans.items():
        last = int(ctx[row] + n_q[row])  # positions written once this step's keys are in
        cut = (s[:, 0] < last) & (s[:, 1] > max(int(ctx[row]), 0)) & (s[:, 1] > last)
        if cut.any():
            start, end = (int(x) for x in s[cut][0])
            raise ValueError(
                f"row {row}: bidirectional span [{start}, {end}) is split by the step (keys up to {last} written)"
            )


def widen(visible: np.ndarray, spans: Spans, rows: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> None:
    """visible [R, Q, L] |= (query and key in the same span), for the group's rows (indices into the batch)."""
    for j, row in enumerate(rows.tolist()):
        for start, end in spans.get(row, ()):
            q_in = (q_pos[j] >= start) & (q_pos[j] < end)
            k_in = (k_pos[j] >= start) & (k_pos[j] < end)
            visible[j] |= q_in[:, None] & k_in[None, :]
