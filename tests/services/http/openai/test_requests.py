"""OpenAI request bodies → TGI Parameters, and body errors."""

from __future__ import annotations

import orjson
import pytest

from services.http.errors import Failure
from services.http.openai import requests as oa
from services.http.tgi.schemas import parse_body

MODEL = "org/tiny"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> oa.ChatRequest:
    return parse_body(orjson.dumps({"messages": MESSAGES, **fields}), oa.ChatRequest)


def chat_params(**fields):
    return oa.chat_parameters(chat(**fields), MODEL)


def completion_params(**fields):
    return oa.completion_parameters(parse_body(orjson.dumps({"prompt": "x", **fields}), oa.CompletionRequest), MODEL)


@pytest.mark.parametrize("build", [chat_params, completion_params])
def test_temperature_zero_is_greedy_anything_else_samples(build):
    p = build(temperature=0)
    assert (p.do_sample, p.temperature) == (False, None)
    p = build(temperature=0.0)
    assert (p.do_sample, p.temperature) == (False, None)
    p = build()  # absent: TGI samples
    assert (p.do_sample, p.temperature) == (True, None)
    p = build(temperature=None)
    assert (p.do_sample, p.temperature) == (True, None)
    p = build(temperature=0.7)
    assert (p.do_sample, p.temperature) == (True, 0.7)


def test_chat_fixed_values():
    p = chat_params()
    assert p.details is True and p.decoder_input_details is False and p.return_full_text is False
    assert p.best_of is None and p.top_k is None and p.typical_p is None and p.truncate is None
    assert p.watermark is False and p.grammar is None and p.top_n_tokens is None and p.stop == []


def test_chat_presence_penalty_is_repetition_penalty_plus_two():
    assert chat_params(presence_penalty=0.0).repetition_penalty == 2.0
    assert chat_params(presence_penalty=-2.0).repetition_penalty == 0.0  # the tokenizer refuses it, as TGI
    assert chat_params(presence_penalty=0.5).repetition_penalty == 2.5
    assert chat_params().repetition_penalty is None
    assert chat_params(frequency_penalty=0.3).frequency_penalty == 0.3


def test_chat_max_tokens_and_its_new_name():
    assert chat_params(max_tokens=7).max_new_tokens == 7
    assert chat_params(max_completion_tokens=9).max_new_tokens == 9
    assert chat_params(max_tokens=7, max_completion_tokens=9).max_new_tokens == 7
    assert chat_params().max_new_tokens is None


def test_chat_other_fields():
    p = chat_params(top_p=0.9, seed=42, stop=["\n", "END"], top_logprobs=3, logprobs=True)
    assert (p.top_p, p.seed, p.stop, p.top_n_tokens) == (0.9, 42, ["\n", "END"], 3)
    assert chat_params(stop="END").stop == ["END"]  # a bare string too (TGI wants a list)
    assert chat_params(n=3, logit_bias=[0.5]).max_new_tokens is None  # accepted, ignored


@pytest.mark.parametrize("build", [chat_params, completion_params])
def test_openai_sampling_extras(build):
    p = build(logit_bias={"50256": -100, "7": 2.5}, min_p=0.1, ignore_eos=True, min_tokens=3, stop_token_ids=[9, 4])
    assert p.logit_bias == {50256: -100.0, 7: 2.5}
    assert (p.min_p, p.ignore_eos, p.min_tokens, p.stop_token_ids) == (0.1, True, 3, [9, 4])
    p = build()
    assert (p.logit_bias, p.min_p, p.ignore_eos, p.min_tokens, p.stop_token_ids) == (None, None, False, None, [])


def test_chat_logit_bias_as_tgi_array_is_accepted_and_ignored():
    assert chat_params(logit_bias=[0.5, -1.0]).logit_bias is None


def test_completion_logit_bias_array_is_refused():
    with pytest.raises(Failure) as e:
        completion_params(logit_bias=[0.5])
    assert e.value.status == 422


def test_model_becomes_adapter_id_unless_tgi_or_the_served_model():
    assert chat_params(model="tgi").adapter_id is None
    assert chat_params(model=MODEL).adapter_id is None
    assert chat_params().adapter_id is None
    assert chat_params(model="my-lora").adapter_id == "my-lora"
    assert completion_params(model="my-lora").adapter_id == "my-lora"


def test_response_format_is_the_grammar():
    fmt = {"type": "json", "value": {"properties": {"a": {"type": "string"}}}}
    assert chat_params(response_format=fmt).grammar == fmt
    assert chat_params(response_format={"type": "text"}).grammar is None


def test_completion_parameters():
    p = completion_params(max_tokens=5, top_p=0.5, seed=3, stop="x", repetition_penalty=1.2, frequency_penalty=0.1)
    assert (p.max_new_tokens, p.top_p, p.seed, p.stop) == (5, 0.5, 3, ["x"])
    assert (p.repetition_penalty, p.frequency_penalty) == (1.2, 0.1)
    assert p.details is True and p.return_full_text is False and p.top_n_tokens is None


def test_completion_prompts():
    assert parse_body(b'{"prompt": "a"}', oa.CompletionRequest).prompts == ["a"]
    assert parse_body(b'{"prompt": ["a", "b"]}', oa.CompletionRequest).prompts == ["a", "b"]


@pytest.mark.parametrize(
    "raw, status, words",
    [
        (b"{not json", 400, "Failed to parse the request body as JSON"),
        (b'{"prompt": []}', 422, "Empty array detected. Do not use an empty array for the prompt."),
        (b'{"prompt": 3}', 422, "Failed to deserialize the JSON body into the target type"),
        (b'{"prompt": "a", "max_tokens": -1}', 422, "Failed to deserialize"),
        (b'{"prompt": "a", "seed": -1}', 422, "Failed to deserialize"),
    ],
)
def test_completion_body_errors(raw, status, words):
    with pytest.raises(Failure) as e:
        parse_body(raw, oa.CompletionRequest)
    assert e.value.status == status and words in e.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "user", "content": None}]},  # null content and no tool_calls
        {"messages": [{"role": "user"}]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
        {"messages": MESSAGES, "logit_bias": {"x": -100}},  # OpenAI's map is keyed by token ids
        {"messages": MESSAGES, "tools": [{"type": "function"}]},
        {"messages": MESSAGES, "stream": None},
        {},
    ],
)
def test_chat_body_errors(fields):
    with pytest.raises(Failure) as e:
        parse_body(orjson.dumps(fields), oa.ChatRequest)
    assert e.value.status == 422
    assert e.value.message.startswith("Failed to deserialize the JSON body into the target type: ")


def test_chat_bodies_accepted():
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    body = chat(
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": parts},
            {"role": "assistant", "tool_calls": [{"id": "0", "type": "function", "function": {"name": "f"}}]},
            {"role": "tool", "content": "3", "tool_call_id": "0"},
        ],
        stream_options=None,
        chat_template_kwargs={"enable_thinking": False},
        unknown_field=1,
    )
    assert body.messages[1]["content"] == parts  # forwarded as sent
    assert body.messages[3]["tool_call_id"] == "0"
    assert body.include_usage is False
    assert chat(stream_options={"include_usage": True}).include_usage is True


def test_model_names_that_mean_the_base_model():
    from services.http.openai.requests import adapter

    for model in (None, "", "tgi", "dummy", "org/served"):  # dummy: huggingface_hub's placeholder for "no model"
        assert adapter(model, "org/served") is None, model
    assert adapter("my-lora", "org/served") == "my-lora"


def test_every_reasoning_effort_the_sdk_sends_is_accepted():
    """The openai SDK's own list (chat's reasoning_effort, the Responses API's reasoning.effort): each is the
    template's variable as sent and a thinking budget; `none` ends the reasoning at once, `max` sets no budget."""
    from typing import get_args

    from openai.types.shared.reasoning_effort import ReasoningEffort

    efforts = get_args(get_args(ReasoningEffort)[0])  # Optional[Literal[…]]
    assert set(efforts) == set(oa.REASONING_EFFORT)
    for effort in efforts:
        body = chat(reasoning_effort=effort)
        assert oa.template_kwargs(body) == {"reasoning_effort": effort}
        assert oa.thinking_budget(body) == oa.REASONING_EFFORT[effort]
    assert oa.thinking_budget(chat(reasoning_effort="none")) == 0
    assert oa.thinking_budget(chat(reasoning_effort="max")) is None
    with pytest.raises(ValueError, match="none, minimal, low, medium, high, xhigh, max"):
        oa.thinking_budget(chat(reasoning_effort="enormous"))
