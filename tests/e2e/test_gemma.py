"""End to end on the real embedded Gemma-3-270M (served by its short name, `--model-id gemma-3-270m`): 16
concurrent greedy requests equal transformers' generate() token for token."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import requests
from transformers import AutoTokenizer

from libs.runtime import model_store
from tests.e2e.server import SMALL_KV, Server
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e
GEMMA = "gemma-3-270m"  # the embedded model's short name (libs/runtime/model_store.py)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "In 1969, the first humans",
    "Translate to French: Good morning, how are you?",
    "A haiku about autumn leaves:",
    "The quick brown fox",
    "Photosynthesis is the process by which plants",
    "List three benefits of regular exercise:\n1.",
    "The largest planet in our solar system is",
    "Here is a short poem about the moon:",
    "To make a cup of tea, first",
    "Machine learning is a field of study that",
    "The Eiffel Tower was built in",
]


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    with Server(GEMMA, tmp_path_factory.mktemp("logs") / "gemma-server.log", *SMALL_KV) as server:
        yield server


def test_gemma_concurrent_greedy_equals_transformers(gemma_server):
    model_dir = model_store.resolve_model(GEMMA)
    info = requests.get(gemma_server.url + "/info", timeout=10).json()
    assert info["model_id"] == GEMMA
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # 4 to 16 new tokens: requests end at different steps, so the batch shrinks as they go (151 tokens in all; the
    # reference decodes each one alone in float32 over a 262k vocabulary, the larger share of this test's time)
    cases = [(p, 4 + (i * 3) % 13) for i, p in enumerate(PROMPTS)]

    async def run_all():
        async with aiohttp.ClientSession() as session:

            async def one(text, n):
                body = {"inputs": text, "parameters": {"max_new_tokens": n, "details": True}}
                async with session.post(gemma_server.url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            return await asyncio.gather(*(one(text, n) for text, n in cases))

    start = time.perf_counter()
    outputs = asyncio.run(run_all())
    elapsed = time.perf_counter() - start
    generated = sum(o["details"]["generated_tokens"] for o in outputs)
    print(f"\nGemma-3-270M, 16 concurrent: {generated} tokens in {elapsed:.2f}s = {generated / elapsed:.1f} tok/s")
    for (text, n), out in zip(cases, outputs):
        ids = [t["id"] for t in out["details"]["tokens"]]
        assert ids == reference_generate(model_dir, tokenizer(text).input_ids, n), text
        assert out["generated_text"] == tokenizer.decode(ids, skip_special_tokens=True)
