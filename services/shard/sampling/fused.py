"""The choice by the C++ kernel (services/shard/cpu_kernels/sampling.cpp) on CPU in half precision, for a batch whose
rows' final scores are their logits over a temperature: no penalty, bias, grammar or truncating warper, and
alternatives only on rows at temperature 1. The kernel reads the logits in place, a row in one parallel pass for the
reduction and one for a draw, where the stages make a float32 copy of the batch and several passes over it (at a
262k vocabulary and 64 rows each pass goes to memory).

The same choice as the stages: greedy rows the first argmax; sampled rows by inversion from the same generator
numbers as draws.py, over weights whose exp is within a few ulp of torch's (a token differs only where the number
falls within that of a boundary); logprobs within ~1e-6. Not the counter-keyed draws (counter.py), which stay
with the stages.
"""

from __future__ import annotations

import torch

from libs.protocol.params import SamplingParams

# batches chosen by the kernel in this process (tests read it to show the kernel ran)
batches = 0


def takes(params: list[SamplingParams]) -> bool:
    """Whether every row's scores are its logits over its temperature (and any alternatives asked for are of the
    logits themselves)."""
    return not any(
        p.keeps_history() or p.biases() or p.truncates() or (p.top_n_tokens > 0 and p.temperature != 1.0)
        for p in params
    )


def choose(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, ...]:
    """Per row: the token, the max and logsumexp − max of its scores (float32), and its score at the token."""
    global batches
    batches += 1
    temps = [p.temperature for p in params]
    divide = any(t != 1.0 for t in temps)
    temperatures = torch.tensor(temps if divide else [], dtype=torch.float32)
    token_ids, maxes, spreads = torch.ops.switchyard_cpu.reduce_rows(logits, temperatures)
    drawn = [i for i, p in enumerate(params) if p.samples()]
    if drawn:
        # one number per drawn row from its generator, in row order, as draws.py takes them
        uniforms = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in drawn])
        rows = torch.tensor(drawn, dtype=torch.long)
        token_ids[rows] = torch.ops.switchyard_cpu.draw_rows(logits, rows, temperatures, maxes, uniforms)
    picked = logits.gather(1, token_ids[:, None])[:, 0].float()
    if divide:
        picked = picked / temperatures
    return token_ids, maxes, spreads, picked
