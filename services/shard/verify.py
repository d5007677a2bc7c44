"""Speculative decoding on the shard: which positions reach the LM head, and which drafted tokens are accepted.

A drafted row feeds [its last token, d1..dk] (the scheduler drafts, services/scheduler/drafting.py). Each of its
k+1 positions is scored as if it were an ordinary decode step there: the processors see the history up to that
position, the draw is seeded by the position of the token it draws, and the token is picked exactly as `choose`
picks it (argmax, or a seeded draw). The row keeps the longest prefix of picks that equal the drafts, plus
the first pick that differs (or the bonus pick after the last draft).

For a deterministic draft this is the standard acceptance rule (accept d with probability p(d); on rejection draw
from p without d, renormalised): the kept token at every position is a plain draw from p, whatever the draft was.
And because no pick depends on the draft, a seeded request yields the same tokens with and without speculation.
"""

from __future__ import annotations

import numpy as np
import torch

from services.shard.sampling.sampler import Choice


def kept_positions(
    cu: np.ndarray, sample_rows: np.ndarray, prompt_rows: list[int], drafts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Positions that reach the LM head, in order: (keep, where each pick's logits are among them, where each
    prompt row's run of logits starts among them).

    A sampled row has 1 + drafts[i] picks: its last 1 + drafts[i] positions. Without prompt rows or drafts only the
    last position of each sampled row is kept (the common, cheap case).
    """
    if not prompt_rows and drafts is None:
        keep = cu[1:][sample_rows] - 1
        return keep, np.arange(len(keep)), []
    runs, sample_at, prompt_at = [], [], []
    kept = 0
    prompt = set(prompt_rows)
    for i in range(len(cu) - 1):
        picks = 1 + (int(drafts[i]) if drafts is not None else 0)
        if i in prompt:
            runs.append(np.arange(cu[i], cu[i + 1]))
            prompt_at.append(kept)
        elif sample_rows[i]:
            runs.append(np.arange(cu[i + 1] - picks, cu[i + 1]))
        else:
            continue
        kept += len(runs[-1])
        if sample_rows[i]:
            sample_at.extend(range(kept - picks, kept))
    return np.concatenate(runs), np.asarray(sample_at, dtype=np.int64), prompt_at


class PickGenerators:
    """Generators for the picks of drafted rows, one per pick of a step (each is reseeded before its draw)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.Generator] = []

    def get(self, i: int) -> torch.Generator:
        while len(self._pool) <= i:
            self._pool.append(torch.Generator(device=self.device))
        return self._pool[i]


def expand_picks(states: list, drafted: list[np.ndarray], keys: list | None, pool: PickGenerators):
    """Per pick: (its row's state, a generator, its history, its grammar key, its grammar chain) from per-sampled-row
    lists (`drafted`: each row's drafts).

    A pick sees the history up to its position (the drafts before it, not the ones after). A drafted row's
    picks each get a generator of their own; an undrafted row keeps its own. A grammar row's pick j is masked by
    the grammar after the row's first j drafts: its chain is (the row's drafts, j) (None: an undrafted row).
    """
    picks = [1 + len(d) for d in drafted]
    out_states, generators, histories = [], [], []
    for st, n in zip(states, picks):
        view = None if st.history is None else st.history.view()
        for j in range(n):
            out_states.append(st)
            generators.append(st.generator if n == 1 else pool.get(len(generators)))
            histories.append(None if view is None else view[: len(view) - n + 1 + j])
    chains = None
    if keys is not None:
        rows = [d.tolist() for d in drafted]
        chains = [None if n == 1 else (d, j) for d, n in zip(rows, picks) for j in range(n)]
        keys = [k for k, n in zip(keys, picks) for _ in range(n)]
    return out_states, generators, histories, keys, chains


def accept(picks: np.ndarray, drafted: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(which picks are kept [n picks] bool, tokens kept per sampled row).

    `picks` holds every sampled row's picks, row after row (1 + its drafts each); `drafted` the drafts of each
    sampled row. A row keeps picks while the previous pick equals the draft at its place.
    """
    keep = np.zeros(len(picks), dtype=bool)
    counts = np.empty(len(drafted), dtype=np.int32)
    at = 0
    for r, drafts in enumerate(drafted):
        k = len(drafts)
        match = picks[at : at + k] == drafts
        n = 1 + (k if match.all() else int(np.argmin(match)))  # the first mismatch's pick is kept too
        keep[at : at + n] = True
        counts[r] = n
        at += k + 1
    return keep, counts


def select(choice: Choice, keep: np.ndarray) -> Choice:
    """The kept picks of a choice, with their alternatives."""
    mask = torch.from_numpy(keep).to(choice.token_ids.device)
    out = Choice(choice.token_ids[mask], choice.logprobs[mask])
    if choice.top_counts is not None:
        out.top_counts = choice.top_counts[mask]
        alternatives = torch.repeat_interleave(mask, choice.top_counts)
        out.top_ids, out.top_logprobs = choice.top_ids[alternatives], choice.top_logprobs[alternatives]
    return out
