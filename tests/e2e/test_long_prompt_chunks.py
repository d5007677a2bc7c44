"""The prefill cap while decoding through the real processes, in tokens (`--max-prefill-tokens-while-decoding`) and
in time alone (`--max-prefill-ms-while-decoding`, the token cap off): a long prompt that arrives while streams
decode is fed in chunks (the scheduler's `chunked_prefills` counter rises, which the default prefill budget would
not make it do for a prompt this short), and every output still equals transformers' generate() token for token."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.e2e.test_generate import counter_rises, prompt, scheduler_counter
from tests.reference import reference_generate

CAP = 32


# a token cap; a time cap alone (1 ms: a chunk of one block once a prefill was timed, 128 tokens before that)
CAPS = {
    "tokens": ["--max-prefill-tokens-while-decoding", str(CAP)],
    "ms": ["--max-prefill-tokens-while-decoding", "0", "--max-prefill-ms-while-decoding", "1"],
}


@pytest.fixture(scope="module", params=list(CAPS))
def capped_server(request, tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / f"long-prompt-chunks-{request.param}.log"
    flags = ["--max-total-tokens", "512", "--max-input-tokens", "400", *CAPS[request.param]]
    with Server(tiny_model_dir, log, *flags) as server:
        yield server


async def _stream(session, url: str, text: str, max_new: int, started: asyncio.Event) -> list[int]:
    """Greedy token ids of a streamed generation; `started` is set at its first token."""
    body = {"inputs": text, "parameters": {"max_new_tokens": max_new}}
    ids = []
    async with session.post(url + "/generate_stream", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
                started.set()
    return ids


def test_a_long_prompt_among_streams_is_chunked_and_exact(capped_server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    streams = [prompt(i) for i in range(1, 5)]
    long_text = " ".join(prompt(i) for i in range(10, 15))
    long_ids = tok(long_text).input_ids
    assert 4 * CAP < len(long_ids) <= 400, len(long_ids)
    before = scheduler_counter(capped_server.url, "chunked_prefills")

    async def scenario():
        async with aiohttp.ClientSession() as session:
            started = asyncio.Event()
            running = [asyncio.ensure_future(_stream(session, capped_server.url, t, 100, started)) for t in streams]
            await started.wait()  # the streams decode: the long prompt arrives among them
            long = await _stream(session, capped_server.url, long_text, 8, asyncio.Event())
            return long, await asyncio.gather(*running)

    long, outs = asyncio.run(scenario())
    assert long == reference_generate(tiny_model_dir, long_ids, 8)
    for text, ids in zip(streams, outs):
        assert ids == reference_generate(tiny_model_dir, tok(text).input_ids, 100)
    assert counter_rises(capped_server.url, "chunked_prefills", before)
