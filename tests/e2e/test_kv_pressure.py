"""The engine under pressure, through the real processes: a small KV cache (preemption by recompute), a small
prefill budget (chunked prefill) and prompts sharing a long prefix (prefix-cache hits); greedy output still
equals transformers' generate() token for token, and the scheduler's counters show each mechanism ran."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.e2e.test_generate import counter_rises, generate, prompt, scheduler_counter
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e


def test_prefix_chunks_and_preemption_keep_greedy_output(pressed_server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    shared = prompt(5)  # ~70 tokens: four full blocks shared by every prompt
    texts = [f"{shared} {prompt(i)[:40]}" for i in range(1, 9)]
    texts = [t for t in texts if len(tok(t).input_ids) <= 100]
    assert len(texts) >= 6
    before = {n: scheduler_counter(pressed_server.url, n) for n in ("preemptions", "prefix_hit_tokens")}
    before["chunked_prefills"] = scheduler_counter(pressed_server.url, "chunked_prefills")

    async def scenario():
        async with aiohttp.ClientSession() as session:
            first = await generate(session, pressed_server.url, texts[0], 4, False)  # fills the prefix cache
            rest = [generate(session, pressed_server.url, t, 60, i % 2 == 0) for i, t in enumerate(texts)]
            return [first, *await asyncio.gather(*rest)]

    results = asyncio.run(scenario())
    assert results[0][0] == reference_generate(tiny_model_dir, tok(texts[0]).input_ids, 4)
    for text, (ids, _, _) in zip(texts, results[1:]):
        assert ids == reference_generate(tiny_model_dir, tok(text).input_ids, 60)
    for name, value in before.items():
        assert counter_rises(pressed_server.url, name, value), name
