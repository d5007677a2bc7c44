"""A minimal scheduler for the shard tests: drives a ModelRunner through a continuous-batching schedule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from libs.protocol import codec
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan, StepResult
from services.shard.model_runner import ModelRunner
from tests.tiny_models import EOS


@dataclass
class Request:
    prompt: list[int]
    max_new: int
    join: int  # the step it is admitted at
    chunk: int = 0  # prefill chunk size (0 = whole prompt in one step)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: str = ""  # llguidance grammar text (structured output)
    replay: list[int] = field(default_factory=list)  # generated tokens the prompt ends with (a recompute)


def drive(
    runner: ModelRunner,
    requests: list[Request],
    pool_seed: int = 1,
    on_result: Callable[[StepPlan, StepResult], None] | None = None,
) -> dict[int, list[int]]:
    """Each request's generated tokens (stops on EOS or max_new, like generate); `on_result` sees every step."""
    bs = runner.block_size
    free = [int(b) for b in np.random.default_rng(pool_seed).permutation(runner.num_blocks)]
    out: dict[int, list[int]] = {}
    ctx: dict[int, int] = {}
    owned: dict[int, list[int]] = {}
    finished: list[int] = []
    step = 0
    while step == 0 or ctx or any(r.join > step for r in requests):
        step += 1
        new = [
            NewSequence(seq, r.sampling, grammar=r.grammar, grammar_ids=r.replay)
            for seq, r in enumerate(requests)
            if r.join == step
        ]
        for ns in new:
            out[ns.seq], ctx[ns.seq], owned[ns.seq] = [], 0, []
        rows, blocks = [], {}
        for seq in sorted(ctx):
            prompt, chunk = requests[seq].prompt, requests[seq].chunk
            if ctx[seq] < len(prompt):  # (a chunk of) the prefill
                n = min(chunk or len(prompt), len(prompt) - ctx[seq])
                toks, sample = prompt[ctx[seq] : ctx[seq] + n], ctx[seq] + n == len(prompt)
            else:
                toks, sample = [out[seq][-1]], True
            need = -(-(ctx[seq] + len(toks)) // bs) - len(owned[seq])
            if need > 0:
                blocks[seq] = [free.pop() for _ in range(need)]
                owned[seq] += blocks[seq]
            rows.append((seq, len(toks), ctx[seq], toks, sample))
        plan = StepPlan(
            step=step,
            new=new,
            blocks=blocks,
            finished=finished,
            seqs=np.array([r[0] for r in rows], np.int32),
            num_tokens=np.array([r[1] for r in rows], np.int32),
            context_lens=np.array([r[2] for r in rows], np.int32),
            token_ids=np.array([t for r in rows for t in r[3]], np.int32),
            sample=np.array([r[4] for r in rows], np.uint8),
        )
        plan.check()
        result = codec.decode(codec.encode(runner.execute(plan)))  # what the scheduler would receive
        assert result.step == step
        assert result.seqs.dtype == np.int32 and result.token_ids.dtype == np.int32
        assert result.logprobs.dtype == np.float32 and (result.logprobs <= 0).all()
        assert result.seqs.tolist() == [r[0] for r in rows if r[4]]
        if on_result is not None:
            on_result(plan, result)
        finished = []
        for seq, n, *_ in rows:
            ctx[seq] += n
        for seq, tok in zip(result.seqs.tolist(), result.token_ids.tolist()):
            out[seq].append(tok)
            if tok == EOS or len(out[seq]) == requests[seq].max_new:
                finished.append(seq)
                free += owned.pop(seq)  # reused at once by later joiners: stale KV must not leak
                del ctx[seq]
    flush = codec.decode(codec.encode(StepPlan(step=step + 1, finished=finished)))  # drop the last finished seqs
    runner.execute(flush)
    assert runner.seqs == {}
    return out
