"""Structured output in the model runner, on a tiny random-weight model (whose unconstrained output is garbage):
constrained rows validate whatever the model prefers, unconstrained rows beside them are untouched, a recompute
replays its matcher, and a row whose grammar fails is reported alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer

from libs.protocol.params import SamplingParams
from services.shard.model_runner import ModelRunner
from services.tokenizer.grammar import grammar_text
from tests.shard.driver import Request, drive
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


def test_constrained_rows_validate_and_unconstrained_rows_are_untouched(runner, tiny_dirs, tok):
    prompts = prompts_for(tiny_dirs["qwen2"])
    schema = grammar_text({"type": "json", "value": SCHEMA})[1]
    regex = grammar_text({"type": "regex", "value": REGEX})[1]
    sampled = SamplingParams(do_sample=True, temperature=1.5, seed=7)
    requests = [
        Request(prompts[0], 60, join=1, grammar=schema),
        Request(prompts[1], 30, join=1),  # unconstrained, in the same batches
        Request(prompts[2], 60, join=2, grammar=regex, chunk=16),
        Request(prompts[3], 60, join=3, grammar=schema, sampling=sampled),
        Request(prompts[4], 30, join=3, sampling=sampled),
    ]
    constrained = []
    out = drive(runner, requests, on_result=lambda plan, result: constrained.append(dict(result.errors)))
    assert all(errors == {} for errors in constrained)
    for seq in (0, 3):
        jsonschema.validate(json.loads(text(tok, out[seq])), SCHEMA)
    assert re.fullmatch(REGEX, text(tok, out[2]))
    alone = drive(runner, [Request(prompts[1], 30, join=1), Request(prompts[4], 30, join=3, sampling=sampled)])
    assert [out[1], out[4]] == [alone[0], alone[1]]  # the masks touched only their own rows
    assert runner.grammars.constraints is not None and len(runner.grammars.constraints) == 0  # all discarded


def test_a_recompute_replays_the_matcher(runner, tiny_dirs):
    prompt = prompts_for(tiny_dirs["qwen2"])[2]
    schema = grammar_text({"type": "json", "value": SCHEMA})[1]
    full = drive(runner, [Request(prompt, 60, join=1, grammar=schema)])[0]
    for cut in (1, len(full) // 2):
        # preempted after `cut` tokens: readmitted with prompt + generated fed again, its matcher rebuilt
        again = drive(runner, [Request(prompt + full[:cut], 60 - cut, join=1, grammar=schema, replay=full[:cut])])
        assert full[:cut] + again[0] == full


def test_a_failing_grammar_fails_its_row_alone(runner, tiny_dirs):
    prompts = prompts_for(tiny_dirs["qwen2"])
    broken = '{"grammars": [{"lark_grammar": "start: nope"}]}'  # never compiles: no token is ever allowed
    seen = []
    out = drive(
        runner,
        [Request(prompts[0], 1, join=1, grammar=broken), Request(prompts[1], 5, join=1)],
        on_result=lambda plan, result: seen.append(dict(result.errors)),
    )
    assert list(seen[0]) == [0] and "nope" in seen[0][0]
    assert out[0] == [EOS]  # the failed row can only end; the scheduler fails that request
    assert len(out[1]) == 5 and all(not errors for errors in seen[1:])


def test_unconstrained_steps_build_no_masks(runner, tiny_dirs, monkeypatch):
    prompts = prompts_for(tiny_dirs["qwen2"])
    regex = grammar_text({"type": "regex", "value": REGEX})[1]
    drive(runner, [Request(prompts[0], 20, join=1, grammar=regex)])  # the matchers exist now
    cons = runner.grammars.constraints
    calls = []
    for name in ("apply", "advance", "masks"):
        real = getattr(cons, name)
        monkeypatch.setattr(cons, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    drive(runner, [Request(prompts[1], 3, join=1)])
    assert calls == []
    drive(runner, [Request(prompts[1], 3, join=1, grammar=regex)])
    assert "apply" in calls and "advance" in calls


def test_the_shard_logs_its_grammar_totals_when_the_last_constrained_row_ends(runner, tiny_dirs, caplog):
    prompts = prompts_for(tiny_dirs["qwen2"])
    schema = grammar_text({"type": "json", "value": SCHEMA})[1]
    cons = runner.grammars.constraints  # None until a first grammar (it has a len: test it against None)
    before = dict(cons.stats) if cons is not None else {"steps": 0, "reused": 0}
    with caplog.at_level("INFO", logger="switchyard.shard.grammar"):
        out = drive(runner, [Request(prompts[0], 40, join=1, grammar=schema), Request(prompts[1], 40, join=1)])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("grammar totals:")]
    assert len(lines) == 1  # once, when the constrained row ended (not per step)
    totals = dict(field.split("=") for field in lines[0].removeprefix("grammar totals: ").split())
    assert int(totals["steps"]) - before["steps"] == len(out[0])  # one masked step per token it generated
    assert int(totals["reused"]) > before["reused"] or int(totals["compiled"]) >= 1
    assert float(totals["apply_s"]) > 0 and float(totals["fill_ahead_s"]) > 0
