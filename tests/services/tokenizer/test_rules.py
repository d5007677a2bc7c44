"""Every TGI validation rule through the tokenizer's Processor (real tiny tokenizer): exact message and error_type,
and TGI's order: a request that breaks two rules gets the earlier one's message.

Limits (conftest.LIMITS): max_input_tokens=20, max_total_tokens=30, max_stop_sequences=4, max_best_of=2,
max_top_n_tokens=5. "hello" is 5 tokens (with <bos>); "the cat sat " * k is 5k + 3 tokens.
"""

from __future__ import annotations

import pytest

from libs.protocol.messages import RequestError, TokenizedRequest
from libs.runtime.settings import Settings
from services.tokenizer.processor import Processor

from .conftest import LIMITS, request

LONG_23 = "the cat sat " * 4  # > max_input_tokens, room for one new token
LONG_33 = "the cat sat " * 6  # > max_total_tokens

SAMPLE = dict(do_sample=True)  # best_of > 1 needs sampling

# (name, request kwargs, exact message after "Input validation error: "), in TGI's check order
RULES = [
    ("BestOfStream", dict(stream=True, best_of=2, **SAMPLE), "`best_of` != 1 is not supported when streaming tokens"),
    ("BestOfStream0", dict(stream=True, best_of=0), "`best_of` != 1 is not supported when streaming tokens"),
    (
        "PrefillDetailsStream",
        dict(stream=True, decoder_input_details=True),
        "`decoder_input_details` == true is not supported when streaming tokens",
    ),
    ("BestOf", dict(best_of=3, **SAMPLE), "`best_of` must be > 0 and <= 2. Given: 3"),
    ("BestOfSampling", dict(best_of=2), "you must use sampling when `best_of` is > 1"),
    ("Temperature", dict(temperature=0.0), "`temperature` must be strictly positive"),
    ("Temperature-f32", dict(temperature=1e-50), "`temperature` must be strictly positive"),
    ("RepetitionPenalty", dict(repetition_penalty=0.0), "`repetition_penalty` must be strictly positive"),
    ("RepetitionPenalty-neg", dict(repetition_penalty=-1.0), "`repetition_penalty` must be strictly positive"),
    ("FrequencyPenalty-high", dict(frequency_penalty=2.5), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("FrequencyPenalty-low", dict(frequency_penalty=-2.01), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("TopP-0", dict(top_p=0.0), "`top_p` must be > 0.0 and < 1.0"),
    ("TopP-1", dict(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
    ("TypicalP-0", dict(typical_p=0.0), "`typical_p` must be > 0.0 and < 1.0"),
    ("TypicalP-1", dict(typical_p=1.0), "`typical_p` must be > 0.0 and < 1.0"),
    ("TypicalP-f32", dict(typical_p=0.999999999), "`typical_p` must be > 0.0 and < 1.0"),
    ("TopK", dict(top_k=0), "`top_k` must be strictly positive"),
    ("NegativeMaxNewTokens", dict(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
    ("StopSequence", dict(stop=["a"] * 5), "`stop` supports up to 4 stop sequences. Given: 5"),
    ("BestOfSeed", dict(best_of=2, seed=7, **SAMPLE), "`seed` must not be set when `best_of` > 1"),
    ("TopNTokens", dict(top_n_tokens=6), "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ("EmptyInput", dict(inputs=""), "`inputs` cannot be empty"),
    ("Truncate-0", dict(truncate=0), "`truncate` must be strictly positive and less than 20. Given: 0"),
    ("Truncate-big", dict(truncate=21), "`truncate` must be strictly positive and less than 20. Given: 21"),
    (
        "MaxTotalTokens",
        dict(max_new_tokens=26),
        "`inputs` tokens + `max_new_tokens` must be <= 30. Given: 5 `inputs` tokens and 26 `max_new_tokens`",
    ),
    (
        "MaxTotalTokens-null",
        dict(inputs=LONG_33),
        "`inputs` tokens + `max_new_tokens` must be <= 30. Given: 33 `inputs` tokens and 0 `max_new_tokens`",
    ),
    ("InputLength", dict(inputs=LONG_23, max_new_tokens=1), "`inputs` must have less than 20 tokens. Given: 23"),
    ("Grammar", dict(grammar={"type": "xml", "value": "a+"}), "grammar is not supported"),
    ("Grammar-json", dict(grammar={"type": "json", "value": 5}), "grammar is not supported"),
    ("Grammar-regex", dict(grammar={"type": "regex", "value": 5}), "grammar is not valid: a regex must be a string"),
]


def run(processor, **kw):
    inputs = kw.pop("inputs", "hello")
    return processor.process(request(inputs, **kw))


def expect_error(result, message):
    assert isinstance(result, RequestError), result
    assert result.request_id == "r" * 32
    assert result.error_type == "validation"
    assert result.message == "Input validation error: " + message


@pytest.mark.parametrize("name,kw,message", RULES, ids=[r[0] for r in RULES])
def test_rule(processor, name, kw, message):
    expect_error(run(processor, **kw), message)


def test_best_of_disabled(settings):
    single = Processor.from_settings(settings.replace(max_best_of=1))
    expect_error(run(single, best_of=2, do_sample=True), "`best_of` != 1 is not allowed for this endpoint")
    assert isinstance(run(single, best_of=1), TokenizedRequest)


# Each row breaks two rules (or more); the one TGI checks first wins. Adjacent pairs along the whole order.
ORDER = [
    ("stream best_of + decoder details", dict(stream=True, best_of=2, decoder_input_details=True), "BestOfStream"),
    ("stream beats best_of range", dict(stream=True, best_of=5, **SAMPLE), "BestOfStream"),
    ("stream details before the rest", dict(stream=True, decoder_input_details=True, temperature=0.0), "Prefill"),
    ("best_of range before sampling", dict(best_of=3), "BestOf"),
    ("best_of sampling before penalties", dict(best_of=2, repetition_penalty=0.0), "BestOfSampling"),
    # a *set* temperature counts as sampling for best_of, so the temperature rule is what fails
    ("set temperature is sampling", dict(best_of=2, temperature=0.0), "Temperature"),
    ("temperature before repetition", dict(temperature=0.0, repetition_penalty=0.0), "Temperature"),
    ("repetition before frequency", dict(repetition_penalty=0.0, frequency_penalty=3.0), "RepetitionPenalty"),
    ("frequency before top_p", dict(frequency_penalty=3.0, top_p=1.0), "FrequencyPenalty-high"),
    ("top_p before typical_p", dict(top_p=1.0, typical_p=1.0), "TopP-1"),
    ("typical_p before top_k", dict(typical_p=1.0, top_k=0), "TypicalP-1"),
    ("top_k before max_new_tokens", dict(top_k=0, max_new_tokens=0), "TopK"),
    ("max_new_tokens before stop", dict(max_new_tokens=0, stop=["a"] * 5), "NegativeMaxNewTokens"),
    ("stop before best_of seed", dict(stop=["a"] * 5, best_of=2, seed=1, **SAMPLE), "StopSequence"),
    ("best_of seed before top_n", dict(best_of=2, seed=1, top_n_tokens=6, **SAMPLE), "BestOfSeed"),
    ("top_n before empty", dict(top_n_tokens=6, inputs=""), "TopNTokens"),
    ("empty before truncate", dict(inputs="", truncate=0), "EmptyInput"),
    ("truncate before lengths", dict(inputs=LONG_33, truncate=0), "Truncate-0"),
    ("total before input length", dict(inputs=LONG_33, max_new_tokens=1), "MaxTotalTokens-long"),
    ("input length before grammar", dict(inputs=LONG_23, max_new_tokens=1, grammar={"type": "regex"}), "InputLength"),
    (
        "everything at once",
        dict(
            best_of=3,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=0,
            stop=["a"] * 9,
            seed=1,
            top_n_tokens=9,
            inputs="",
            truncate=0,
            grammar={"type": "regex"},
        ),
        "BestOf",
    ),
]
MESSAGES = {name: message for name, _, message in RULES} | {
    "Prefill": "`decoder_input_details` == true is not supported when streaming tokens",
    "MaxTotalTokens-long": "`inputs` tokens + `max_new_tokens` must be <= 30. Given: 33 `inputs` tokens and 1 "
    "`max_new_tokens`",
}


@pytest.mark.parametrize("name,kw,first", ORDER, ids=[r[0] for r in ORDER])
def test_order(processor, name, kw, first):
    expect_error(run(processor, **kw), MESSAGES[first])


VALID = [
    dict(),
    dict(best_of=2, do_sample=True),  # each fanned-out copy: fine, and gets its own seed
    dict(best_of=2, top_k=5),  # a set warper is sampling for best_of
    dict(best_of=0),  # 0 and 1 are a plain request (not on a stream)
    dict(best_of=1, stream=True),
    dict(decoder_input_details=True),
    dict(repetition_penalty=0.1, frequency_penalty=-2.0, typical_p=0.5, top_n_tokens=5, watermark=True),
    dict(frequency_penalty=2.0, top_n_tokens=0),
    dict(adapter_id=""),  # no adapter: the base model (an unknown adapter is an error: test_lora_validation.py)
    dict(inputs=LONG_33, truncate=20),  # truncation first, then the length checks
    dict(max_new_tokens=25),  # 5 + 25 == 30
]


@pytest.mark.parametrize("kw", VALID)
def test_valid(processor, kw):
    result = run(processor, **kw)
    assert isinstance(result, TokenizedRequest), result


def test_chunk_rule_uses_at_most_1024(tiny_dir):
    # TGI checks input + min(max_new_tokens, 1024): 5 + 1024 <= 2000 passes although 5 + 5000 does not fit
    big = Processor.from_settings(Settings(model_path=str(tiny_dir), max_input_tokens=1000, max_total_tokens=2000))
    result = run(big, max_new_tokens=5000)
    assert isinstance(result, TokenizedRequest)
    assert result.max_new_tokens == 2000 - 5  # capped at max_total_tokens: no auto-continuation here


def test_limits_are_the_settings():
    assert LIMITS["max_best_of"] == 2 and LIMITS["max_top_n_tokens"] == 5  # the messages above depend on them
