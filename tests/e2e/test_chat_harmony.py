"""gpt-oss's harmony format served end to end: a tiny random gpt-oss-shaped model (tests/harmony_model.py: the
harmony markers as special tokens, gpt-oss's own chat template, `<|return|>` / `<|call|>` its EOS tokens). Random
weights never write harmony on their own, so a thinking budget and tool_choice force its messages (the grammar
writes the markers as their tokens); what the model writes inside them is its own. The markers never reach the
client: the analysis channel is reasoning_content (the Responses API's reasoning item, Anthropic's thinking block),
the final channel content, a commentary message to=functions.NAME a tool call."""

from __future__ import annotations

import json

import anthropic
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from services.http.anthropic.signature import sign
from tests.e2e.server import Server
from tests.harmony_model import MARKERS, build_harmony_model

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {  # an enum: a random model's string would run to max_tokens
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    folder = build_harmony_model(tmp_path_factory.mktemp("models") / "tiny-harmony")
    log = tmp_path_factory.mktemp("logs") / "harmony.log"
    with Server(folder, log, "--max-total-tokens", "1024") as s:
        yield s, Tokenizer.from_file(str(folder / "tokenizer.json")), log, folder


def _clean(*texts):
    for text in texts:
        assert not any(m in (text or "") for m in MARKERS), text


def _streamed(client, **kw) -> tuple[str, str, dict, str | None]:
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model="tgi", messages=ASK, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            got = calls.setdefault(call.index, ["", ""])
            got[0] += call.function.name or ""
            got[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, {i: tuple(c) for i, c in calls.items()}, finish


def test_analysis_under_a_budget_is_reasoning_and_may_hold_lt(harmony):
    server, tok, log, _ = harmony
    client = OpenAI(base_url=server.url + "/v1", api_key="-")
    lt = tok.token_to_id("<")
    # the model is pushed to write `<` (and the budget of 4 tokens then forces `<|end|>`, the final channel follows)
    kw = dict(max_tokens=24, temperature=0, logit_bias={str(lt): 30}, extra_body={"thinking_token_budget": 4})
    choice = client.chat.completions.create(model="tgi", messages=ASK, **kw).choices[0]
    reasoning, content = choice.message.reasoning_content, choice.message.content
    assert reasoning and "<" in reasoning, reasoning  # `<` in reasoning under a budget
    assert content, "no final message after the analysis: the budget's end was not forced"
    _clean(reasoning, content)
    assert _streamed(client, **kw)[:2] == (reasoning, content)
    assert "special tokens kept in the text" in log.read_text()  # the detokenizer was told so by the format


def test_a_forced_call_is_a_tool_call(harmony):
    server, *_ = harmony
    client = OpenAI(base_url=server.url + "/v1", api_key="-")
    kw = dict(
        max_tokens=96, temperature=0, tools=TOOLS, tool_choice="required", extra_body={"thinking_token_budget": 3}
    )
    choice = client.chat.completions.create(model="tgi", messages=ASK, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice  # `<|call|>` ended the turn
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.message.reasoning_content and not choice.message.content
    _clean(choice.message.reasoning_content, call.function.arguments)
    reasoning, content, calls, finish = _streamed(client, **kw)
    assert (reasoning, calls, finish) == (
        choice.message.reasoning_content,
        {0: ("get_weather", call.function.arguments)},
        "tool_calls",
    )
    # the call and its result go back through gpt-oss's own template, and the next turn answers
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    done = client.chat.completions.create(
        model="tgi", messages=follow, tools=TOOLS, max_tokens=40, temperature=0, extra_body={"thinking_token_budget": 2}
    ).choices[0]
    assert done.message.reasoning_content and done.message.content and not done.message.tool_calls
    _clean(done.message.reasoning_content, done.message.content)


def test_responses_and_anthropic_read_the_channels(harmony):
    server, *_ = harmony
    response = OpenAI(base_url=server.url + "/v1", api_key="-").responses.create(
        model="tgi", input="Why is the sky blue?", max_output_tokens=20, temperature=0, reasoning={"effort": "low"}
    )
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning"
    _clean(response.output_text, response.output[0].content[0].text)
    client = anthropic.Anthropic(base_url=server.url, api_key="-")
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    greedy = {"temperature": 0}  # (this SDK version's create takes no temperature argument)
    kw = dict(
        model="tgi", max_tokens=40, messages=ask, thinking={"type": "enabled", "budget_tokens": 3}, extra_body=greedy
    )
    message = client.messages.create(**kw)
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.signature == sign(thinking.thinking)
    _clean(*(getattr(b, "thinking", None) or getattr(b, "text", "") for b in message.content))
    # streamed: the SDK assembles the same block, its signature from the signature_delta event
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    # Claude Code sends the blocks back in the next turn (signed, or redacted): accepted; gpt-oss's template drops a
    # finished turn's reasoning (a call turn's it shows: test_earlier_reasoning_and_effort_reach_the_template)
    turn = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": "And at sunset?"},
    ]
    plain = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content if b.type != "thinking"]},
        {"role": "user", "content": "And at sunset?"},
    ]
    redacted = [{**turn[1], "content": [{"type": "redacted_thinking", "data": "opaque"}, *turn[1]["content"][1:]]}]
    for messages in (turn, ask + redacted + turn[2:]):
        assert client.messages.create(**{**kw, "messages": messages, "max_tokens": 4}).usage.output_tokens > 0
        counted = client.messages.count_tokens(model="tgi", messages=messages).input_tokens
        assert counted == client.messages.count_tokens(model="tgi", messages=plain).input_tokens


THOUGHT = "Paris means get_weather."
ARGS = {"city": "Paris"}


def test_earlier_reasoning_and_effort_reach_the_template(harmony):
    # an agent loop's call turn with its reasoning, as each API sends it back, and a reasoning effort: the prompt is
    # apply_chat_template's with the reasoning as gpt-oss's `thinking` and the effort on its `Reasoning:` line
    import requests
    from transformers import AutoTokenizer

    server, tok, _, folder = harmony
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}
    reference = [
        *ASK,
        {
            "role": "assistant",
            "thinking": THOUGHT,
            "tool_calls": [{**call, "function": {**call["function"], "arguments": ARGS}}],
        },
        result,
    ]

    def expected(effort: str) -> list[int]:
        text = AutoTokenizer.from_pretrained(folder).apply_chat_template(
            reference, tools=TOOLS, add_generation_prompt=True, tokenize=False, reasoning_effort=effort
        )
        assert THOUGHT in text and f"Reasoning: {effort}\n" in text
        return tok.encode(text, add_special_tokens=False).ids

    chat = [*ASK, {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [call]}, result]
    body = {"messages": chat, "tools": TOOLS, "reasoning_effort": "high"}
    got = requests.post(server.url + "/chat_tokenize", json=body, timeout=60).json()
    assert [t["id"] for t in got["tokenize_response"]] == expected("high")
    items = [
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'},
    ]
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    response = OpenAI(base_url=server.url + "/v1", api_key="-").responses.create(
        model="tgi", input=items, tools=flat, reasoning={"effort": "low"}, max_output_tokens=2, store=False
    )
    assert response.usage.input_tokens == len(expected("low"))
    blocks = [
        {"type": "thinking", "thinking": THOUGHT, "signature": sign(THOUGHT)},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": ARGS},
    ]
    turn = [*ASK, {"role": "assistant", "content": blocks}]
    turn.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": '{"sky": "clear"}'}]}
    )
    tools = [
        {
            "name": "get_weather",
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    counted = anthropic.Anthropic(base_url=server.url, api_key="-").messages.count_tokens(
        model="tgi", messages=turn, tools=tools, output_config={"effort": "xhigh"}
    )
    assert counted.input_tokens == len(expected("high"))  # Anthropic's xhigh is the chat's high
    # the counts tell the efforts apart from the template's default (medium) on this tokenizer
    assert len(expected("medium")) not in (len(expected("low")), len(expected("high")))


def test_tgi_tool_prompt_reads_no_markers(harmony):
    # TGI's tool_prompt asks for TGI's tool mode: its grammar forces TGI's JSON, and the answer ends with <|call|> or
    # <|return|>, special tokens the text keeps for this model; the call is read from the text without them
    server, *_ = harmony
    client = OpenAI(base_url=server.url + "/v1", api_key="-")
    kw = dict(max_tokens=60, temperature=0, tools=TOOLS, tool_choice="required", extra_body={"tool_prompt": "Call."})
    choice = client.chat.completions.create(model="tgi", messages=ASK, **kw).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    _clean(call.function.arguments)
    _, content, calls, _ = _streamed(client, **kw)
    assert calls == {0: ("get_weather", call.function.arguments)} and not content
    flat = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tool_prompt, the same way
    response = client.responses.create(
        model="tgi", input=ASK[0]["content"], tools=flat, tool_choice="required", max_output_tokens=60,
        temperature=0, extra_body={"tool_prompt": "Call."},
    )  # fmt: skip
    assert [(i.type, i.name, i.arguments) for i in response.output] == [
        ("function_call", "get_weather", call.function.arguments)
    ]


def test_greedy_tokens_equal_generate(harmony):
    # the tiny model with the markers added to its vocabulary serves exactly: /generate's greedy tokens are generate()'s
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server, tok, _, folder = harmony
    prompt = AutoTokenizer.from_pretrained(folder).apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
    got = requests.post(server.url + "/generate", json=body, timeout=60).json()
    ids = [t["id"] for t in got["details"]["tokens"]]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    prompt_ids = torch.tensor([tok.encode(prompt).ids])  # as /generate tokenizes it (its <bos> added)
    want = model.generate(prompt_ids, max_new_tokens=12, do_sample=False)[0, prompt_ids.shape[1] :].tolist()
    assert ids == want
