"""The in-process engine: the scheduler's Batcher and the shard's ModelRunner in one loop, no bus.

One step is what a scheduler and its rank-0 shard do between them: plan → execute → apply. With `wire` (the
default) the plan and the result are encoded and decoded as on the bus, so what runs here is what crosses it.
Tests (greedy output against transformers) and the in-process benchmarks (bench.step) drive the model through
it; no service imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from libs.protocol import codec
from libs.protocol.messages import FINISH_ERROR, TokenizedRequest
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import StepPlan, StepResult
from libs.runtime import model_store
from services.scheduler.batcher import Batcher
from services.scheduler.sequence import Emitted
from services.scheduler.token_batch import stream_open
from services.shard.model_runner import ModelRunner


def request(
    rid: str, prompt, max_new: int, *, grammar: str = "", adapter: str | None = None, **sampling
) -> TokenizedRequest:
    """A tokenized request as the tokenizer would admit it: `sampling` are SamplingParams fields."""
    return TokenizedRequest(
        request_id=rid,
        ingress=0,
        input_ids=np.asarray(prompt, np.int32),
        sampling=SamplingParams(**sampling),
        max_new_tokens=max_new,
        grammar=grammar,
        adapter=adapter,
    )


@dataclass
class Output:
    """What one request got: its tokens, their logprobs and alternatives, its prompt's logprobs, how it ended."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    finish: int = 0
    error: str | None = None  # why the shard failed this request alone (StepResult.errors)


class Engine:
    def __init__(self, runner: ModelRunner, batcher: Batcher, *, wire: bool = True) -> None:
        """A new engine's batcher starts its sequence handles afresh: the runner forgets what it held, as a shard
        does at a new scheduler's probe."""
        runner.reset()
        self.runner, self.batcher, self.wire = runner, batcher, wire
        self.steps = 0
        self.outputs: dict[str, Output] = {}
        self.on_step: Callable[[StepPlan, StepResult], None] | None = None  # sees every step (tests, benchmarks)

    @classmethod
    def build(
        cls,
        runner: ModelRunner,
        model_dir: str | None,
        *,
        max_batch_size: int = 256,
        max_batch_prefill_tokens: int = 4096,
        wire: bool = True,
        eos_ids: set[int] | None = None,
        **batcher_kw,
    ) -> Engine:
        """An engine over `runner` with a Batcher of the runner's KV geometry and the EOS ids of the model in
        `model_dir` (`eos_ids` instead, for a model built in memory; an empty set: every request runs to its
        max_new_tokens, as benchmarks want)."""
        batcher = Batcher(
            runner.num_blocks,
            max_batch_size=max_batch_size,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            eos_ids=set(model_store.model_info(str(model_dir))["eos_token_ids"]) if eos_ids is None else eos_ids,
            block_size=runner.block_size,
            **batcher_kw,
        )
        return cls(runner, batcher, wire=wire)

    def add(self, req: TokenizedRequest) -> None:
        self.batcher.add(req)
        self.outputs.setdefault(req.request_id, Output())

    def step(self) -> list[Emitted] | None:
        """One step: the rows it emitted, or None when nothing was planned (no work, or none that fits now)."""
        if not self.batcher.has_work():
            return None
        self.steps += 1
        plan = self.batcher.plan(self.steps)
        if plan is None:
            return None
        result = self._wire(self.runner.execute(self._wire(plan)))
        if result.error is not None:
            raise RuntimeError(f"step {plan.step} failed on the shard: {result.error}")
        if self.on_step is not None:
            self.on_step(plan, result)
        failed = [self._fail(seq, why) for seq, why in result.errors.items()]  # as the scheduler's _fail_rows
        rows = [r for r in failed if r is not None] + self.batcher.apply(result)
        for row in rows:
            self._record(row)
        return rows

    def run(self, arrivals: dict[int, list[TokenizedRequest]] | None = None, max_steps: int = 100_000) -> dict:
        """Step until every request ended; `arrivals` adds requests before the step of that number (0: before
        the first). Returns each request's Output."""
        arrivals = dict(arrivals or {})
        for _ in range(max_steps):
            for req in arrivals.pop(self.steps, []):
                self.add(req)
            if self.step() is None and not self.batcher.has_work():
                if not arrivals:
                    return self.outputs
                self.steps = min(arrivals)  # idle until the next arrival
        raise RuntimeError(f"not done after {max_steps} steps")

    def _fail(self, seq: int, why: str) -> Emitted | None:
        s = self.batcher.running.get(seq)
        if s is None:
            return None
        self.outputs[s.req.request_id].error = why
        return self.batcher.finish(s.req.request_id, FINISH_ERROR)

    def _record(self, row: Emitted) -> None:
        out = self.outputs[row.seq.req.request_id]
        if not row.seq.opened:
            out.prompt_logprobs = stream_open(row, 0).prompt_logprobs
        if row.token_id >= 0:
            if row.offset != len(out.tokens):
                raise AssertionError(f"{row.seq.req.request_id}: offset {row.offset} after {len(out.tokens)} tokens")
            out.tokens.append(row.token_id)
            out.logprobs.append(row.logprob)
            out.top.append((row.top_ids, row.top_logprobs))
        out.finish = row.finish

    def _wire(self, msg):
        return codec.decode(codec.encode(msg)) if self.wire else msg
