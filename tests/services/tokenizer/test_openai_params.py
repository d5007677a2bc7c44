"""The OpenAI / vLLM sampling parameters in the tokenizer: their checks (vLLM's messages, after TGI's rules) and
what they resolve to (SamplingParams: logit_bias, min_p, ignore_eos, stop_token_ids, min_tokens as a mask length)."""

from __future__ import annotations

import pytest

from libs.protocol import codec
from libs.protocol.messages import RequestError, TokenizedRequest
from libs.protocol.params import Parameters
from services.tokenizer.validation import ValidationError, check_openai_parameters, check_parameters, resolve

from .conftest import request

VOCAB = 1000


def check(**kw):
    check_openai_parameters(Parameters(**kw), vocab_size=VOCAB)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1."),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
        (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
        (dict(min_tokens=5, max_new_tokens=4), "min_tokens must be less than or equal to max_tokens=4, got 5."),
        (dict(logit_bias={3: 100.5}), "logit_bias values must be in [-100, 100], got 100.5 for token_id 3."),
        (dict(logit_bias={3: -101.0}), "logit_bias values must be in [-100, 100], got -101.0 for token_id 3."),
        (
            dict(logit_bias={3: 1.0, 1000: 1.0, -1: 2.0}),
            "token_id(s) [1000, -1] in logit_bias contain out-of-vocab token ids. Vocabulary size: 1000",
        ),
        (
            dict(stop_token_ids=[5, 1000]),
            "token_id(s) [1000] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 1000",
        ),
    ],
)
def test_rule(kw, message):
    with pytest.raises(ValidationError) as e:
        check(**kw)
    assert e.value.message == message


@pytest.mark.parametrize(
    "kw",
    [
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(min_tokens=4, max_new_tokens=4),
        dict(min_tokens=4),  # no max_tokens: nothing to compare with
        dict(logit_bias={0: -100.0, 999: 100.0}),
        dict(stop_token_ids=[0, 999]),
        dict(ignore_eos=True),
    ],
)
def test_valid(kw):
    check(**kw)


def test_tgi_rules_come_first():
    p = Parameters(temperature=0.0, min_p=2.0)
    with pytest.raises(ValidationError, match="temperature"):
        check_parameters(p, "x", max_stop_sequences=4, max_input_tokens=10)


def test_resolve_sampled():
    p = Parameters(do_sample=True, min_p=0.2, logit_bias={7: -100.0}, min_tokens=3, stop_token_ids=[9])
    s = resolve(p, [1, 2, 3, 4], max_input_tokens=10, max_total_tokens=20, eos_ids=[2]).sampling
    assert (s.min_p, s.logit_bias, s.stop_token_ids, s.min_tokens, s.ignore_eos) == (0.2, {7: -100.0}, [9], 3, False)
    assert (s.min_length, s.min_length_ids) == (4 + 3, [2, 9])  # prompt + min_tokens; EOS and the stop ids


def test_resolve_greedy_keeps_the_processors_not_min_p():
    p = Parameters(min_p=0.2, logit_bias={7: 1.0}, ignore_eos=True, min_tokens=2, stop_token_ids=[9])
    s = resolve(p, [1, 2, 3], max_input_tokens=10, max_total_tokens=20, eos_ids=[2]).sampling
    assert not s.samples() and s.min_p == 0.0  # a warper: greedy ignores it (as transformers without do_sample)
    assert (s.logit_bias, s.ignore_eos, s.min_length, s.min_length_ids) == ({7: 1.0}, True, 5, [9])


def test_resolve_defaults_change_nothing():
    s = resolve(Parameters(), [1, 2], max_input_tokens=10, max_total_tokens=20, eos_ids=[2]).sampling
    assert not s.biases() and not s.warps() and (s.min_length, s.min_length_ids, s.min_tokens) == (0, [], 0)


def test_processor_resolves_and_refuses(processor):
    out = processor.process(request("hello", max_new_tokens=5, min_tokens=2, logit_bias={4: 3.0}, stop_token_ids=[6]))
    assert isinstance(out, TokenizedRequest)
    s = codec.decode(codec.encode(out)).sampling  # what crosses the bus
    assert s.logit_bias == {4: 3.0} and s.stop_token_ids == [6] and s.min_tokens == 2
    assert s.min_length == len(out.input_ids) + 2 and set(processor.eos_ids) | {6} == set(s.min_length_ids)
    out = processor.process(request("hello", max_new_tokens=5, stop_token_ids=[processor.vocab_size]))
    assert isinstance(out, RequestError) and out.error_type == "validation"
    assert out.message.startswith("Input validation error: token_id(s) [")
