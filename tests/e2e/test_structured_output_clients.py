"""Structured output through the official clients, unmodified: the openai SDK (parse with a pydantic model,
tools, its stream helper), huggingface_hub's InferenceClient and text_generation's Grammar, on the tiny model."""

from __future__ import annotations

import asyncio
import re
from typing import Literal

import openai
import pytest
from huggingface_hub import InferenceClient
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.e2e.test_structured_output import REGEX, SCHEMAS, TOOL_PARAMS, TOOL_PROMPT, TOOLS, check_call, check_json

pytestmark = pytest.mark.e2e


# ---- the official clients, unmodified ---------------------------------------------------------------------------
class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    tags: list[Literal["a", "b"]] = Field(max_length=3)


ASK = [{"role": "user", "content": "the weather please"}]


def test_openai_sdk_parse_tools_and_stream_helper(tiny_server):
    client = OpenAI(base_url=tiny_server.url + "/v1", api_key="-")
    parsed = client.chat.completions.parse(model="tgi", messages=ASK, response_format=Weather, max_tokens=80, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    tool = openai.pydantic_function_tool(Weather)
    extra = {"tool_prompt": TOOL_PROMPT}
    kwargs = dict(model="tgi", messages=ASK, tools=[tool], tool_choice="required", max_tokens=80, extra_body=extra)
    called = client.chat.completions.parse(**kwargs, temperature=0)
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)
    with client.chat.completions.stream(**kwargs, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == ("Weather", call.function.arguments)
    assert streamed.function.parsed_arguments == call.function.parsed_arguments

    async def run():
        aclient = AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="-")
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}
        out = await aclient.chat.completions.create(model="tgi", messages=ASK, response_format=fmt, max_tokens=80)
        return out.choices[0].message.content

    Weather.model_validate_json(asyncio.run(run()))


def test_huggingface_hub_client(tiny_server):
    client = InferenceClient(base_url=tiny_server.url)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}
    out = client.chat_completion(ASK, model="tgi", response_format=fmt, max_tokens=80, seed=3)
    Weather.model_validate_json(out.choices[0].message.content)
    out = client.chat_completion(
        ASK, model="tgi", tools=TOOLS, tool_choice="required", tool_prompt=TOOL_PROMPT, max_tokens=80
    )
    call = out.choices[0].message.tool_calls[0]
    check_call({"type": call.type, "function": {"name": call.function.name, "arguments": call.function.arguments}})
    chunks = client.chat_completion(
        ASK, model="tgi", tools=TOOLS, tool_choice="get_weather", tool_prompt=TOOL_PROMPT, max_tokens=80, stream=True
    )
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in chunks if c.choices)
    check_json(arguments, TOOL_PARAMS["get_weather"])


def test_text_generation_client_grammars(tiny_server):
    client = Client(tiny_server.url, timeout=60)
    schema = SCHEMAS["nested"]
    r = client.generate("hello", max_new_tokens=120, grammar=Grammar(type=GrammarType.Json, value=schema))
    assert r.details.finish_reason == "eos_token"
    check_json(r.generated_text, schema)
    r = client.generate("hello", max_new_tokens=40, grammar=Grammar(type=GrammarType.Regex, value=REGEX))
    assert re.fullmatch(REGEX, r.generated_text)
    streamed = list(
        client.generate_stream("hello", max_new_tokens=40, grammar=Grammar(type=GrammarType.Regex, value=REGEX))
    )
    assert re.fullmatch(REGEX, streamed[-1].generated_text)
