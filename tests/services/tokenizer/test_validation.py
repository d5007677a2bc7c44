"""TGI's validation rules: one row per rule (exact message), rule order, truncation, max_new_tokens resolution."""

import pytest

from libs.protocol.params import Parameters, SamplingParams
from services.tokenizer.validation import ValidationError, check_parameters, resolve

MAX_STOP, MAX_INPUT, MAX_TOTAL = 4, 100, 200


def check(inputs="hello", **kw):
    check_parameters(Parameters(**kw), inputs, max_stop_sequences=MAX_STOP, max_input_tokens=MAX_INPUT)


def res(n_ids, **kw):
    return resolve(Parameters(**kw), list(range(n_ids)), max_input_tokens=MAX_INPUT, max_total_tokens=MAX_TOTAL)


PARAM_RULES = [
    # (inputs, parameters, exact message)
    ("x", dict(temperature=0.0), "`temperature` must be strictly positive"),
    ("x", dict(temperature=-1.0), "`temperature` must be strictly positive"),
    ("x", dict(temperature=1e-50), "`temperature` must be strictly positive"),  # 0.0 as f32
    ("x", dict(top_p=0.0), "`top_p` must be > 0.0 and < 1.0"),
    ("x", dict(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
    ("x", dict(top_p=0.999999999), "`top_p` must be > 0.0 and < 1.0"),  # 1.0 as f32
    ("x", dict(top_k=0), "`top_k` must be strictly positive"),
    ("x", dict(top_k=-3), "`top_k` must be strictly positive"),
    ("x", dict(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
    ("x", dict(stop=["a"] * 5), "`stop` supports up to 4 stop sequences. Given: 5"),
    ("", dict(), "`inputs` cannot be empty"),
    ("x", dict(truncate=0), "`truncate` must be strictly positive and less than 100. Given: 0"),
    ("x", dict(truncate=101), "`truncate` must be strictly positive and less than 100. Given: 101"),
]


@pytest.mark.parametrize("inputs,kw,message", PARAM_RULES)
def test_parameter_rule(inputs, kw, message):
    with pytest.raises(ValidationError) as e:
        check(inputs, **kw)
    assert e.value.message == message
    assert e.value.full_message == "Input validation error: " + message
    assert e.value.error_type == "validation"


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=0.5, top_p=0.9, top_k=1, max_new_tokens=1, truncate=100, stop=["a"] * 4),
        dict(truncate=1),
    ],
)
def test_valid_parameters_pass(kw):
    check(" ", **kw)  # whitespace is not empty for TGI


# Each row breaks two rules; the earlier one in TGI's order wins.
ORDER = [
    ("", dict(temperature=0.0, top_p=2.0), "`temperature` must be strictly positive"),
    ("", dict(top_p=2.0, top_k=0), "`top_p` must be > 0.0 and < 1.0"),
    ("", dict(top_k=0, max_new_tokens=0), "`top_k` must be strictly positive"),
    ("", dict(max_new_tokens=0, stop=["a"] * 9), "`max_new_tokens` must be strictly positive"),
    ("", dict(stop=["a"] * 9, truncate=0), "`stop` supports up to 4 stop sequences. Given: 9"),
    ("", dict(truncate=0), "`inputs` cannot be empty"),
]


@pytest.mark.parametrize("inputs,kw,message", ORDER)
def test_order(inputs, kw, message):
    with pytest.raises(ValidationError, match=None) as e:
        check(inputs, **kw)
    assert e.value.message == message


LENGTH_RULES = [
    # (number of ids, parameters, exact message); MAX_INPUT=100, MAX_TOTAL=200
    (
        150,
        dict(max_new_tokens=51),
        "`inputs` tokens + `max_new_tokens` must be <= 200. Given: 150 `inputs` tokens and 51 `max_new_tokens`",
    ),
    (
        201,
        dict(),
        "`inputs` tokens + `max_new_tokens` must be <= 200. Given: 201 `inputs` tokens and 0 `max_new_tokens`",
    ),
    (10, dict(max_new_tokens=190), None),  # exactly max_total_tokens
    (
        10,
        dict(max_new_tokens=191),
        "`inputs` tokens + `max_new_tokens` must be <= 200. Given: 10 `inputs` tokens and 191 `max_new_tokens`",
    ),
    (101, dict(max_new_tokens=5), "`inputs` must have less than 100 tokens. Given: 101"),
    (101, dict(), "`inputs` must have less than 100 tokens. Given: 101"),
    # both broken: MaxTotalTokens is checked first
    (
        150,
        dict(max_new_tokens=60),
        "`inputs` tokens + `max_new_tokens` must be <= 200. Given: 150 `inputs` tokens and 60 `max_new_tokens`",
    ),
    # truncation happens before the length checks
    (500, dict(truncate=100, max_new_tokens=100), None),
]


@pytest.mark.parametrize("n,kw,message", LENGTH_RULES)
def test_length_rule(n, kw, message):
    if message is None:
        res(n, **kw)
        return
    with pytest.raises(ValidationError) as e:
        res(n, **kw)
    assert e.value.message == message


def test_length_check_with_large_max_total():
    # the chunk is min(max_new_tokens, 1024): 100 + 1024 <= 2000 passes although 100 + 5000 does not fit;
    # the request is then capped at max_total_tokens
    r = resolve(Parameters(max_new_tokens=5000), [1] * 100, max_input_tokens=1000, max_total_tokens=2000)
    assert r.max_new_tokens == 1900
    with pytest.raises(ValidationError) as e:
        resolve(Parameters(max_new_tokens=5000), [1] * 1000, max_input_tokens=1000, max_total_tokens=2000)
    assert e.value.message.endswith("Given: 1000 `inputs` tokens and 1024 `max_new_tokens`")


def test_truncate_keeps_last_ids():
    r = res(10, truncate=3)
    assert r.input_ids == [7, 8, 9]
    assert res(2, truncate=3).input_ids == [0, 1]  # shorter than truncate: unchanged
    assert res(5).input_ids == [0, 1, 2, 3, 4]


def test_max_new_tokens_resolution():
    assert res(30).max_new_tokens == MAX_TOTAL - 30  # the whole remaining budget, in one go
    assert res(30, truncate=10).max_new_tokens == MAX_TOTAL - 10
    assert res(30, max_new_tokens=7).max_new_tokens == 7
    big = resolve(Parameters(), [1] * 10, max_input_tokens=100, max_total_tokens=5000)
    assert big.max_new_tokens == 4990  # not capped at 1024: no auto-continuation


def test_no_room_for_a_token():
    # only possible when max_input_tokens >= max_total_tokens
    with pytest.raises(ValidationError) as e:
        resolve(Parameters(), [1] * 50, max_input_tokens=50, max_total_tokens=50)
    assert e.value.message.startswith("`inputs` tokens + `max_new_tokens` must be <= 50.")


def test_greedy():
    for kw in [dict(), dict(temperature=1.0), dict(seed=5)]:
        r = res(3, **kw)
        assert r.sampling == SamplingParams(do_sample=False)
        assert r.seed is None


@pytest.mark.parametrize(
    "kw", [dict(do_sample=True), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.9), dict(temperature=1.0, top_k=1)]
)
def test_sampling(kw):
    r = res(3, **kw)
    assert r.sampling.do_sample
    assert r.sampling.seed == r.seed
    assert 0 <= r.seed < 2**64
    assert r.sampling.temperature == kw.get("temperature", 1.0)
    assert r.sampling.top_k == kw.get("top_k", 0)
    assert r.sampling.top_p == kw.get("top_p", 1.0)


def test_seed():
    r = res(3, do_sample=True, seed=42)
    assert (r.seed, r.sampling.seed) == (42, 42)
    seeds = {res(3, do_sample=True).seed for _ in range(8)}
    assert len(seeds) > 1  # random when not given
