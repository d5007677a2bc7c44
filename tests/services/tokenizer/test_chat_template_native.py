"""The model's own template, fully: a conversation with tools, calls and tool results renders exactly as
transformers' apply_chat_template renders it, for Qwen2.5's, Llama 3.1's and Mistral's templates (tests/data); an
assistant turn's earlier reasoning and a reasoning effort, for gpt-oss's and Qwen3's (qwen3.jinja is Qwen3's own
template as TRL's wheel ships it, trl/chat_templates/qwen3.jinja in trl 1.16.0, unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.tokenizer.chat_template import ChatTemplates, InvalidMessage, TemplateError
from tests.tiny_models import build_tokenizer

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ARGS = {"city": "Paris", "days": 2}
# as an OpenAI client sends it: arguments as a JSON string, nulls where the SDK echoes them back
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "abcdefghi",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGS), "description": None},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abcdefghi", "name": "get_weather", "content": '{"temp": 21}'},
]
# the same, as transformers' documentation writes it: arguments a dict, content a string
REFERENCE = [
    CHAT[0],
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}],
    },
    CHAT[3],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.mark.parametrize("name", ["qwen25", "llama31", "mistral"])
def test_prompt_equals_apply_chat_template(tokenizer_dir, name):
    from transformers import AutoTokenizer

    source = (TEMPLATES / f"{name}.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = REFERENCE if name != "mistral" else [REFERENCE[1], *REFERENCE[2:]]
    ours_in = CHAT if name != "mistral" else [CHAT[1], *CHAT[2:]]
    expected = tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=source, add_generation_prompt=True, tokenize=False
    )
    templates = ChatTemplates({"default": source}, bos_token="<bos>", eos_token="<eos>")
    ours = templates.render(ours_in, TOOLS, native=True)
    assert ours == expected
    assert tok(ours, add_special_tokens=False).input_ids == tok(expected, add_special_tokens=False).input_ids
    assert "get_weather" in ours and "temp" in ours and "null" not in ours
    # TGI's flattening (the default) shows the model something else: the proof that the native path did the work
    try:
        flattened = templates.render(ours_in, TOOLS)
    except TemplateError:  # Mistral's template needs the tool message's tool_call_id, which TGI drops
        flattened = None
    assert flattened != expected


def test_unparsable_arguments_are_a_clear_error():
    templates = ChatTemplates({"default": (TEMPLATES / "qwen25.jinja").read_text()})
    bad = [dict(CHAT[2], tool_calls=[{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}])]
    with pytest.raises(InvalidMessage, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        templates.render([CHAT[1], *bad], TOOLS, native=True)


def test_documents_and_kwargs_reach_the_template():
    source = "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ 'T' if enable_thinking else 'F' }}"
    templates = ChatTemplates({"default": source})
    out = templates.render([{"role": "user", "content": "q"}], None, {"enable_thinking": False}, [{"title": "a"}], True)
    assert out == "[a]F"


# an agent loop's current turn: the assistant reasoned, then called; the tool answered. Qwen3's template shows the
# reasoning of assistant turns after the last user message, gpt-oss's the analysis of a tool-call turn with no
# final answer after it: both must see it, under their own names.
THOUGHT = "The user wants Paris, so call get_weather."
CALL = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
REASONED = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "abcdefghi", "name": "get_weather", "content": '{"temp": 21}'},
]


def _reference(key: str) -> list[dict]:
    """REASONED as transformers' documentation writes it for a template that reads `key`."""
    call = {**CALL, "function": {"name": "get_weather", "arguments": ARGS}}
    return [REASONED[0], {"role": "assistant", key: THOUGHT, "tool_calls": [call]}, REASONED[2]]


@pytest.mark.parametrize("name, key", [("gpt_oss", "thinking"), ("qwen3", "reasoning_content")])
@pytest.mark.parametrize("sent_as", ["reasoning_content", "reasoning", "thinking"])
def test_earlier_reasoning_reaches_the_template_by_its_name(tokenizer_dir, name, key, sent_as):
    from transformers import AutoTokenizer

    source = (TEMPLATES / f"{name}.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = tok.apply_chat_template(
        _reference(key), tools=TOOLS, chat_template=source, add_generation_prompt=True, tokenize=False
    )
    sent = [REASONED[0], {**REASONED[1], sent_as: THOUGHT}, REASONED[2]]
    templates = ChatTemplates({"default": source}, bos_token="<bos>", eos_token="<eos>")
    ours = templates.render(sent, TOOLS, native=True)
    assert ours == expected
    assert tok(ours, add_special_tokens=False).input_ids == tok(expected, add_special_tokens=False).input_ids
    assert THOUGHT in ours  # the template rendered it (without it the prompt lacks the reasoning)
    assert THOUGHT not in templates.render(REASONED, TOOLS, native=True)


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_reaches_gpt_oss_template(tokenizer_dir, effort):
    from transformers import AutoTokenizer

    from services.http.openai import requests as oa

    source = (TEMPLATES / "gpt_oss.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = tok.apply_chat_template(
        REASONED[:1], chat_template=source, add_generation_prompt=True, tokenize=False, reasoning_effort=effort
    )
    body = oa.ChatRequest(messages=REASONED[:1], reasoning_effort=effort)
    templates = ChatTemplates({"default": source})
    ours = templates.render(REASONED[:1], None, oa.template_kwargs(body), native=True)
    assert ours == expected and f"Reasoning: {effort}\n" in ours
    # an explicit chat_template_kwargs value wins over reasoning_effort
    body = oa.ChatRequest(
        messages=REASONED[:1], reasoning_effort=effort, chat_template_kwargs={"reasoning_effort": "medium"}
    )
    assert "Reasoning: medium\n" in templates.render(REASONED[:1], None, oa.template_kwargs(body), native=True)


def test_gpt_oss_call_turn_with_content_and_reasoning_renders():
    # gpt-oss's template refuses `thinking` beside content in a call turn: an answer with a preamble, sent back with
    # its reasoning_content, still renders (the content as the turn's analysis, as the template writes it)
    templates = ChatTemplates({"default": (TEMPLATES / "gpt_oss.jinja").read_text()})
    turn = {**REASONED[1], "content": "Checking.", "reasoning_content": THOUGHT}
    ours = templates.render([REASONED[0], turn, REASONED[2]], TOOLS, native=True)
    assert "<|channel|>analysis<|message|>Checking.<|end|>" in ours
    with pytest.raises(TemplateError, match="Cannot pass both content and thinking"):  # sent as `thinking`: as sent
        templates.render([REASONED[0], {**turn, "thinking": THOUGHT}, REASONED[2]], TOOLS, native=True)
