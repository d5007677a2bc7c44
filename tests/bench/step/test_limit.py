"""The limit (bench/step/limit.py) on the tiny bench model: the Batcher prefills the batch, then every decode step
of the whole batch is timed, in wall and CPU time (timings are reported, not tested)."""

from bench import models
from bench.step import limit


def test_limit_reports_cpu_per_decode_step():
    _, view = models.resolve("tiny")
    out = limit.measure(str(view), 2, 8, 4)
    assert out["decode_step_cpu_ms"] > 0 and len(out["decode_step_ms_all"]) == 3  # one prefill step, then 3 decodes
    assert out["tok_s"] > 0 and out["decode_tok_s"] > 0


def test_prompts_beyond_the_step_budget_are_prefilled_in_chunks_before_the_decode_steps():
    _, view = models.resolve("tiny")
    b = limit.Batch(str(view), 3, 40, 4, max_prefill_tokens=64)
    fed = []
    b.engine.on_step = lambda plan, result: fed.append(int(plan.num_tokens.sum()))
    b.start()
    b.prefill()
    assert sum(fed) == 3 * 40 + sum(len(b.engine.outputs[f"r{i}"].tokens) - 1 for i in range(3))  # decodes rode along
    assert max(fed) <= 64 and b.prefilled()
    while b.has_work():
        b.engine.step()
    assert all(len(b.engine.outputs[f"r{i}"].tokens) == 4 for i in range(3))  # no EOS: every request to its length
