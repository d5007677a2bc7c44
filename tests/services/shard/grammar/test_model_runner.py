"""Structured output in the model runner, on a tiny random-weight model (whose unconstrained output is garbage),
driven by the in-process engine (bench/engine.py): constrained rows validate whatever the model prefers,
unconstrained rows beside them are untouched, a recompute after preemption replays its matcher, and a row whose
grammar fails is reported alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer

from bench.engine import Engine, request
from services.scheduler.batcher import Batcher
from services.shard.model_runner import ModelRunner
from services.tokenizer.grammar import grammar_text
from tests.services.shard.test_model_runner import Steps
from tests.tiny_models import EOS, prompts_for

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "tags"],
}
REGEX = r"[0-9]{2,4}-(yes|no)"


@pytest.fixture(scope="module")
def runner(tiny_dirs):
    return ModelRunner(str(tiny_dirs["qwen2"]), num_blocks=96, block_size=4)


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return Tokenizer.from_file(str(tiny_dirs["qwen2"] / "tokenizer.json"))


def text(tok, ids: list[int]) -> str:
    assert ids[-1] == EOS, "a constrained row ends with EOS once its grammar is complete"
    return tok.decode(ids[:-1], skip_special_tokens=False)


def engine_for(runner: ModelRunner, num_blocks: int = 0, **budget) -> Engine:
    """A new engine over the module's runner, which forgets the last one's sequences first (as a new scheduler's
    probe makes it); `num_blocks`: the Batcher's KV, when smaller than the runner's."""
    runner.reset()
    kw = dict(max_batch_size=16, max_batch_prefill_tokens=4096, eos_ids={EOS}, block_size=runner.block_size)
    return Engine(runner, Batcher(num_blocks or runner.num_blocks, **kw, **budget))


def then_one_more(engine: Engine, prompt: list[int]) -> None:
    """One more (unconstrained) request: its plan tells the shard which sequences ended in the last step, as the
    scheduler's next plan would; then the shard holds none of those."""
    engine.run({engine.steps: [request("next", prompt, 1)]})


def test_constrained_rows_validate_and_unconstrained_rows_are_untouched(runner, tiny_dirs, tok):
    prompts = prompts_for(tiny_dirs["qwen2"])
    schema = grammar_text({"type": "json", "value": SCHEMA})[1]
    regex = grammar_text({"type": "regex", "value": REGEX})[1]
    sampled = dict(do_sample=True, temperature=1.5, seed=7)
    arrivals = {
        0: [request("json", prompts[0], 60, grammar=schema), request("plain", prompts[1], 30)],  # the same batches
        1: [request("regex", prompts[2], 60, grammar=regex)],  # chunks of 16 beside the decodes
        2: [
            request("json sampled", prompts[3], 60, grammar=schema, **sampled),
            request("plain sampled", prompts[4], 30, **sampled),
        ],
    }
    engine = engine_for(runner, max_prefill_tokens_while_decoding=16)
    steps = Steps(engine)
    out = {rid: o.tokens for rid, o in engine.run(arrivals).items()}
    assert all(errors == {} for errors in steps.errors)
    assert len(steps.chunks("regex")) > 2 and steps.beside_decodes("regex")  # a constrained prompt's chunks
    assert engine.batcher.counters["constrained_rows"] > 0
    for rid in ("json", "json sampled"):
        jsonschema.validate(json.loads(text(tok, out[rid])), SCHEMA)
    assert re.fullmatch(REGEX, text(tok, out["regex"]))
    then_one_more(engine, prompts[5])
    assert runner.grammars.constraints is not None and len(runner.grammars.constraints) == 0  # all discarded
    alone = engine_for(runner).run({0: [arrivals[0][1]], 2: [arrivals[2][1]]})
    assert [out["plain"], out["plain sampled"]] == [alone["plain"].tokens, alone["plain sampled"].tokens]


@pytest.mark.parametrize("kv_blocks, older", [(24, 29), (28, 14)])
def test_a_recompute_replays_the_matcher(runner, tiny_dirs, kv_blocks, older):
    """KV for 24 (or 28) blocks: the older request's growth preempts the constrained one after a few tokens (or
    about half its answer); readmitted, it is fed its prompt and generated tokens again, and the shard rebuilds
    its matcher replaying those tokens: the answer goes on as if nothing happened."""
    prompts = prompts_for(tiny_dirs["qwen2"])
    schema = grammar_text({"type": "json", "value": SCHEMA})[1]
    full = engine_for(runner).run({0: [request("x", prompts[2], 60, grammar=schema)]})["x"].tokens
    engine = engine_for(runner, kv_blocks)
    replayed = []
    engine.on_step = lambda plan, result: replayed.extend(new.grammar_ids for new in plan.new if new.grammar_ids)
    got = engine.run({0: [request("older", prompts[1][:older], 60)], 1: [request("x", prompts[2], 60, grammar=schema)]})
    assert engine.batcher.counters["preemptions"] > 0 and len(replayed) == 1
    assert 0 < len(replayed[0]) < len(full) and replayed[0] == full[: len(replayed[0])]
    assert got["x"].tokens == full


def test_a_failing_grammar_fails_its_row_alone(runner, tiny_dirs):
    prompts = prompts_for(tiny_dirs["qwen2"])
    broken = '{"grammars": [{"lark_grammar": "start: nope"}]}'  # never compiles: no token is ever allowed
    engine = engine_for(runner)
    seen = Steps(engine).errors
    out = engine.run({0: [request("broken", prompts[0], 1, grammar=broken), request("plain", prompts[1], 5)]})
    assert list(seen[0]) == ["broken"] and "nope" in seen[0]["broken"]
    # the request fails there and then, as the scheduler fails it (its sampled token is never applied)
    assert out["broken"].tokens == [] and out["broken"].error.startswith("grammar: ")
    assert len(out["plain"].tokens) == 5 and all(not errors for errors in seen[1:])


def test_unconstrained_steps_build_no_masks(runner, tiny_dirs, monkeypatch):
    prompts = prompts_for(tiny_dirs["qwen2"])
    regex = grammar_text({"type": "regex", "value": REGEX})[1]
    engine_for(runner).run({0: [request("regex", prompts[0], 20, grammar=regex)]})  # the matchers exist now
    cons = runner.grammars.constraints
    calls = []
    for name in ("apply", "advance", "masks"):
        real = getattr(cons, name)
        monkeypatch.setattr(cons, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    engine_for(runner).run({0: [request("plain", prompts[1], 3)]})
    assert calls == []
    engine_for(runner).run({0: [request("regex", prompts[1], 3, grammar=regex)]})
    assert "apply" in calls and "advance" in calls


def test_the_shard_logs_its_grammar_totals_when_the_last_constrained_row_ends(runner, tiny_dirs, caplog):
    prompts = prompts_for(tiny_dirs["qwen2"])
    schema = grammar_text({"type": "json", "value": SCHEMA})[1]
    cons = runner.grammars.constraints  # None until a first grammar (it has a len: test it against None)
    engine = engine_for(runner)
    before = dict(cons.stats) if cons is not None else {"steps": 0, "reused": 0}
    with caplog.at_level("INFO", logger="switchyard.shard.grammar"):
        out = engine.run({0: [request("json", prompts[0], 40, grammar=schema), request("plain", prompts[1], 40)]})
        then_one_more(engine, prompts[5])  # the plan that tells the shard the last ones ended
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("grammar totals:")]
    assert len(lines) == 1  # once, when the constrained row ended (not per step)
    totals = dict(field.split("=") for field in lines[0].removeprefix("grammar totals: ").split())
    assert int(totals["steps"]) - before["steps"] == len(out["json"].tokens)  # one masked step per token it generated
    assert int(totals["reused"]) > before["reused"] or int(totals["compiled"]) >= 1
    assert float(totals["apply_s"]) > 0 and float(totals["fill_ahead_s"]) > 0
