"""The official clients, unmodified, against the real processes: text_generation's Client and AsyncClient,
the openai SDK (sync and async, chat and completions, streaming) and huggingface_hub's InferenceClient. Each
asserts the content: greedy text equals transformers' generate() on the same prompt (chat: the same template)."""

from __future__ import annotations

import asyncio
import re

import pytest
import requests
import torch
from huggingface_hub import InferenceClient
from openai import AsyncOpenAI, OpenAI
from text_generation import AsyncClient, Client
from text_generation.types import Message

from tests.reference import load_model, reference_generate

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over a lazy dog while seven"
MESSAGES = [{"role": "system", "content": "you hum old songs"}, {"role": "user", "content": "the quick brown fox"}]
N = 8


def clean(tokenizer, ids: list[int]) -> str:
    """generated_text as Switchyard writes it: special tokens skipped, never a U+FFFD (README)."""
    return tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tiny_tokenizer):
    """Greedy reference outputs: (ids, text) for PROMPT (with <bos>) and for MESSAGES through the chat template."""
    prompt_ids = tiny_tokenizer(PROMPT).input_ids
    rendered = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    chat_ids = tiny_tokenizer(rendered, add_special_tokens=False).input_ids
    gen = reference_generate(tiny_model_dir, prompt_ids, N)
    chat = reference_generate(tiny_model_dir, chat_ids, N)
    return {
        "prompt_ids": prompt_ids,
        "gen": gen,
        "text": clean(tiny_tokenizer, gen),
        "rendered": rendered,
        "chat_ids": chat_ids,
        "chat": chat,
        "chat_text": clean(tiny_tokenizer, chat),
    }


def test_text_generation_client(tiny_server, expected):
    client = Client(tiny_server.url, timeout=60)
    r = client.generate(PROMPT, max_new_tokens=N, top_n_tokens=2, decoder_input_details=True)
    assert [t.id for t in r.details.tokens] == expected["gen"] and r.generated_text == expected["text"]
    assert [t.id for t in r.details.prefill] == expected["prompt_ids"]
    assert all(len(alts) >= 2 and alts[0].id == t.id for alts, t in zip(r.details.top_tokens, r.details.tokens))
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=N))
    assert [s.token.id for s in streamed] == expected["gen"] and streamed[-1].generated_text == expected["text"]
    assert streamed[-1].details.generated_tokens == len(expected["gen"])

    chat = client.chat([Message(**m) for m in MESSAGES], max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == expected["chat_text"]
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage["completion_tokens"] == len(expected["chat"])
    assert chat.usage["prompt_tokens"] == len(expected["chat_ids"])
    # The sync client cannot parse the final `data: [DONE]` (TGI sends it too): a caller stops at finish_reason.
    pieces = []
    for chunk in client.chat([Message(**m) for m in MESSAGES], max_tokens=N, temperature=0, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
        if chunk.choices[0].finish_reason:
            break
    assert "".join(pieces) == expected["chat_text"]


def test_text_generation_async_client(tiny_server, expected):
    async def run():
        client = AsyncClient(tiny_server.url, timeout=60)
        r = await client.generate(PROMPT, max_new_tokens=N)
        streamed = [s async for s in client.generate_stream(PROMPT, max_new_tokens=N)]
        chat = await client.chat([Message(**m) for m in MESSAGES], max_tokens=N, temperature=0)
        pieces = []
        async for chunk in await client.chat(
            [Message(**m) for m in MESSAGES], max_tokens=N, temperature=0, stream=True
        ):
            pieces.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].finish_reason:
                break
        return r, streamed, chat, pieces

    r, streamed, chat, pieces = asyncio.run(run())
    assert [t.id for t in r.details.tokens] == expected["gen"] and r.generated_text == expected["text"]
    assert [s.token.id for s in streamed] == expected["gen"] and streamed[-1].generated_text == expected["text"]
    assert chat.choices[0].message.content == expected["chat_text"]
    assert "".join(pieces) == expected["chat_text"]


def test_openai_sync_chat(tiny_server, tiny_model_dir, tiny_tokenizer, expected):
    client = OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected["chat_text"]
    assert r.object == "chat.completion" and r.model == str(tiny_model_dir)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected["chat_ids"]), len(expected["chat"]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(choice.logprobs.content) == len(expected["chat"])
    for item in choice.logprobs.content:  # greedy: the chosen token is the best alternative
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob

    # streaming with include_usage: the deltas add up, then a usage chunk with no choices
    chunks = list(
        client.chat.completions.create(
            model="tgi",
            messages=MESSAGES,
            max_completion_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["chat_text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected["chat"])
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("length", "stop")

    # content as a list of text parts is the same prompt as the joined string (TGI joins parts with "")
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": " brown fox"}]},
    ]
    r2 = client.chat.completions.create(model="tgi", messages=parts, max_tokens=N, temperature=0)
    assert r2.choices[0].message.content == expected["chat_text"]

    # a seed makes a sampled chat repeat
    sampled = [
        client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=N, temperature=0.9, seed=77)
        for _ in range(2)
    ]
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content

    # presence_penalty p is TGI's repetition_penalty p + 2 (greedy)
    r3 = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=N, temperature=0, presence_penalty=0.0
    )
    ids = torch.tensor([expected["chat_ids"]])
    with torch.inference_mode():
        ref = load_model(str(tiny_model_dir)).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False, repetition_penalty=2.0
        )
    assert r3.choices[0].message.content == clean(tiny_tokenizer, ref[0, ids.shape[1] :].tolist())


def test_openai_sync_completions(tiny_server, expected):
    client = OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == expected["text"] and r.choices[0].index == 0
    assert r.usage.completion_tokens == len(expected["gen"])
    assert r.usage.prompt_tokens == len(expected["prompt_ids"])
    chunks = list(client.completions.create(model="tgi", prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason in ("length", "eos_token")
    # two prompts: one choice each, by index
    r = client.completions.create(model="tgi", prompt=[PROMPT, PROMPT], max_tokens=N, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1] and all(c.text == expected["text"] for c in r.choices)
    # a stop sequence ends the completion and is kept
    stop = expected["text"][len(expected["text"]) // 2 :][:2]
    if stop.strip():
        r = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop])
        assert stop in r.choices[0].text and expected["text"].startswith(r.choices[0].text)


def test_openai_async(tiny_server, expected):
    async def run():
        client = AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=N, temperature=0)
        stream = await client.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=N, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        comp = await client.completions.create(model="tgi", prompt=PROMPT, max_tokens=N, temperature=0)
        cstream = await client.completions.create(model="tgi", prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
        cpieces = [c.choices[0].text async for c in cstream]
        await client.close()
        return chat, pieces, comp, cpieces

    chat, pieces, comp, cpieces = asyncio.run(run())
    assert chat.choices[0].message.content == expected["chat_text"] == "".join(pieces)
    assert comp.choices[0].text == expected["text"] == "".join(cpieces)


def test_huggingface_hub_inference_client(tiny_server, expected):
    client = InferenceClient(base_url=tiny_server.url, timeout=60)
    # it posts to `/`, TGI's compat route, where return_full_text defaults to true for a text-generation model
    assert client.text_generation(PROMPT, max_new_tokens=N) == PROMPT + expected["text"]
    kw = {"max_new_tokens": N, "return_full_text": False}
    assert client.text_generation(PROMPT, **kw) == expected["text"]
    out = client.text_generation(PROMPT, details=True, **kw)
    assert [t.id for t in out.details.tokens] == expected["gen"]
    assert out.details.finish_reason in ("length", "eos_token")
    streamed = list(client.text_generation(PROMPT, details=True, stream=True, **kw))
    assert [s.token.id for s in streamed] == expected["gen"] and streamed[-1].generated_text == expected["text"]
    assert "".join(client.text_generation(PROMPT, stream=True, **kw)) == expected["text"]
    chat = client.chat_completion(MESSAGES, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == expected["chat_text"]


def test_tokenize_routes(tiny_server, tiny_tokenizer, expected):
    r = requests.post(tiny_server.url + "/tokenize", json={"inputs": PROMPT, "parameters": {"truncate": 2}})
    tokens = r.json()
    assert [t["id"] for t in tokens] == expected["prompt_ids"]  # /tokenize ignores truncate (TGI)
    raw = PROMPT.encode()
    for t in tokens:  # byte offsets into the input; <bos> covers nothing
        assert t["text"] == raw[t["start"] : t["stop"]].decode(errors="replace")
    assert "".join(t["text"] for t in tokens) == PROMPT
    r = requests.post(tiny_server.url + "/chat_tokenize", json={"messages": MESSAGES})
    body = r.json()
    assert body["templated_text"] == expected["rendered"]
    assert [t["id"] for t in body["tokenize_response"]] == expected["chat_ids"]


def test_info_routes(tiny_server, tiny_model_dir):
    for path in ("/health", "/ping", "/"):
        assert requests.get(tiny_server.url + path).status_code == 200, path
    info = requests.get(tiny_server.url + "/info").json()
    keys = {"model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of"}
    keys |= {"max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers"}
    keys |= {"max_client_batch_size", "router", "version", "sha", "docker_label"}
    assert keys <= set(info) and info["max_best_of"] == 2 and info["max_client_batch_size"] == 4
    models = requests.get(tiny_server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(tiny_model_dir)
    assert models["data"][0]["object"] == "model"
    metrics = requests.get(tiny_server.url + "/metrics")
    assert metrics.status_code == 200 and re.search(r"^\w+(\{[^}]*\})? \S+$", metrics.text, re.M), metrics.text


def test_invocations_dispatches_by_body(tiny_server, expected):
    url = tiny_server.url + "/invocations"
    r = requests.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": N, "return_full_text": False}})
    assert r.json()[0]["generated_text"] == expected["text"]  # the compat route: a list
    r = requests.post(url, json={"messages": MESSAGES, "max_tokens": N, "temperature": 0})
    assert (
        r.json()["object"] == "chat.completion"
        and r.json()["choices"][0]["message"]["content"] == (expected["chat_text"])
    )
    r = requests.post(url, json={"prompt": PROMPT, "max_tokens": N, "temperature": 0})
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == expected["text"]
