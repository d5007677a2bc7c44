"""A request's `priority` as each API takes it: vLLM's field on both OpenAI routes, and TGI's `parameters` as an
extension; an integer, carried to the tokenizer in Parameters (0 when absent)."""

import msgspec
import pytest

from services.http.openai import requests as oa
from services.http.tgi.schemas import GenerateRequest


def test_openai_routes_carry_priority():
    chat = msgspec.json.decode(
        b'{"messages": [{"role": "user", "content": "hi"}], "priority": -2}', type=oa.ChatRequest
    )
    assert oa.chat_parameters(chat, "m").priority == -2
    completion = msgspec.json.decode(b'{"prompt": "hi", "priority": 7}', type=oa.CompletionRequest)
    assert oa.completion_parameters(completion, "m").priority == 7
    plain = msgspec.json.decode(b'{"prompt": "hi"}', type=oa.CompletionRequest)
    assert oa.completion_parameters(plain, "m").priority == 0


def test_generate_parameters_carry_priority():
    body = msgspec.json.decode(b'{"inputs": "hi", "parameters": {"priority": 3}}', type=GenerateRequest)
    assert body.wire_parameters().priority == 3
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"inputs": "hi", "parameters": {"priority": "high"}}', type=GenerateRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"inputs": "hi", "parameters": {"priority": 4294967296}}', type=GenerateRequest)
