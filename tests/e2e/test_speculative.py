"""Speculative decoding end to end (`--speculate 4`) on the default model (SmolLM2-135M-Instruct, float32): a
chat request that copies its input drafts and accepts many tokens, and every answer still equals transformers'
greedy generate() token for token; several tokens per step stream as one SSE event each; a stop sequence that
ends inside a multi-token step ends the text where it matched; `details` gives every token its logprob and top-n;
the counters and TGI's skipped-tokens summary show the drafts on /metrics."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import requests
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from libs.runtime import model_store
from tests.e2e.conftest import fresh_metrics, sse_events
from tests.e2e.server import SMALL_KV, Server
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

TEXT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
MAX_NEW = 48


@pytest.fixture(scope="module")
def folder():
    return model_store.resolve_model(None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "speculate-server.log"
    # every match is drafted: the adaptive rule prices drafts by measured step times, and a loaded stretch (another
    # test worker) turned drafting off for a whole stream, so no step carried several tokens
    flags = ("--speculate", "4", "--speculate-policy", "always")
    with Server(None, log, "--dtype", "float32", *flags, *SMALL_KV) as server:
        yield server


@pytest.fixture(scope="module")
def copy_prompt(folder) -> tuple[str, list[int]]:
    """The copy request as text for /generate (the chat template rendered by transformers) and as ids."""
    messages = [{"role": "user", "content": "Repeat this code exactly:\n\n" + TEXT}]
    rendered = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return rendered, Tokenizer.from_file(str(folder / "tokenizer.json")).encode(rendered, add_special_tokens=False).ids


def generate(server: Server, inputs: str, **parameters) -> dict:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": MAX_NEW, **parameters}}
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def value(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def counter(server: Server, name: str) -> float:
    return value(requests.get(server.url + "/metrics", timeout=10).text, name)


def counts(server: Server, *names: str, role: str = "scheduler") -> tuple[float, ...]:
    """The counters of `role`'s processes as rendered after every request so far has ended (they come from its
    heartbeats, whose renders are paced), all from one scrape, so consistent with each other."""
    text = fresh_metrics(server.url, (role,))
    return tuple(value(text, name) for name in names)


def test_copying_accepts_drafts_and_equals_generate(server, folder):
    # a quoted document (a copy this model makes: below), so that the rule at one stream keeps drafting; asked to
    # repeat the code of copy_prompt, the model rewrites it and the rule may stop after a few rejected drafts
    text, ids = quote_prompt(folder, 0)
    want = reference_generate(folder, ids, MAX_NEW)
    out = generate(server, text, details=True, decoder_input_details=False, top_n_tokens=2)
    tokens = out["details"]["tokens"]
    assert [t["id"] for t in tokens] == want
    assert all(t["logprob"] <= 0 for t in tokens)  # every accepted token has its own logprob …
    alternatives = out["details"]["top_tokens"]  # … and its top-n, from its own step's distribution
    assert len(alternatives) == len(tokens) and all(len(alts) == 2 for alts in alternatives)
    assert all(alts[0]["id"] == t["id"] for alts, t in zip(alternatives, tokens))  # greedy: the best is the pick
    assert out["details"]["generated_tokens"] == len(want)
    drafted, accepted, skipped = counts(
        server,
        "switchyard_speculative_draft_tokens_total",
        "switchyard_speculative_accepted_tokens_total",
        "tgi_request_skipped_tokens_sum",
    )
    assert drafted >= accepted >= 4, (drafted, accepted)  # the copy really was drafted, and drafts accepted
    assert skipped == accepted  # TGI's: tokens − 1 per generation


SSE_COUNTERS = ("switchyard_sse_events_total", "switchyard_sse_writes_total")


def test_streaming_sends_one_event_per_token(server, copy_prompt):
    text, _ = copy_prompt
    whole = generate(server, text, details=True)
    before = counts(server, *SSE_COUNTERS, role="http")  # earlier streams' counts in
    body = {"inputs": text, "parameters": {"max_new_tokens": MAX_NEW}, "stream": True}
    r = requests.post(server.url + "/generate_stream", json=body, timeout=300)
    events = sse_events(r.content)
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))  # TGI's index, one per token
    assert events[-1]["generated_text"] == whole["generated_text"]
    # the multi-token steps' events went out together: fewer socket writes than events (services/http/sse_writer.py)
    now = counts(server, *SSE_COUNTERS, role="http")
    sent, writes = now[0] - before[0], now[1] - before[1]
    assert sent == len(events) and 0 < writes < sent, (sent, writes)


def test_a_stop_sequence_inside_a_multi_token_step(server, copy_prompt):
    text, _ = copy_prompt
    whole = generate(server, text)["generated_text"]
    stop = "return a - b"  # deep in the copy: the tokens around it come several per step
    assert stop in whole
    out = generate(server, text, details=True, stop=[stop])
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"] == whole[: whole.index(stop) + len(stop)]
    # the stream ends at the same token, though the step that held it held more
    params = {"max_new_tokens": MAX_NEW, "stop": [stop], "details": True}
    body = {"inputs": text, "parameters": params, "stream": True}
    events = sse_events(requests.post(server.url + "/generate_stream", json=body, timeout=300).content)
    assert len(events) == out["details"]["generated_tokens"]
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert events[-1]["generated_text"] == out["generated_text"]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(server, copy_prompt):
    text, _ = copy_prompt
    params = {"do_sample": True, "temperature": 0.7, "seed": 5}
    alone = generate(server, text, **params)["generated_text"]
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda seed: generate(server, text, **{**params, "seed": seed}), [5, 6, 5, 7]))
    assert runs[0]["generated_text"] == runs[2]["generated_text"] == alone


DRAFT_COUNTERS = ("switchyard_speculative_draft_tokens_total", "switchyard_speculative_accepted_tokens_total")


def quote_prompt(folder, i: int) -> tuple[str, list[int]]:
    """The bench's copy request for document i (bench/workloads/speculative.py), as text and as ids."""
    from bench.workloads.speculative import document

    messages = [{"role": "user", "content": f"Say exactly this and nothing else: {document(i)}"}]
    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return text, Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def drafts_since(server: Server, before: tuple[float, ...]) -> tuple[float, float]:
    """(drafted, accepted) since `before`, the last request's drafts counted."""
    drafted, accepted = (a - b for a, b in zip(counts(server, *DRAFT_COUNTERS), before))
    return drafted, accepted


def test_a_quoted_document_is_copied_and_most_drafts_are_accepted(server, folder):
    """The bench's copy workload (bench/workloads/speculative.py): the model quotes the document, so the drafts from
    the prompt are its own next tokens. (Asked to repeat a Python module instead, this model rewrote it: its answer
    was no copy and most drafts were rejected, which is what the bench's 1-stream "copy" figure measured.)"""
    from bench.workloads.speculative import document

    text, ids = quote_prompt(folder, 2)
    before = counts(server, *DRAFT_COUNTERS)
    out = generate(server, text, details=True, max_new_tokens=96)
    assert [t["id"] for t in out["details"]["tokens"]] == reference_generate(folder, ids, 96)
    assert document(2) in out["generated_text"]
    drafted, accepted = drafts_since(server, before)
    assert accepted >= 0.5 * drafted > 0, (drafted, accepted)


def test_a_constrained_copy_drafts_and_equals_generate(server, folder):
    """A grammar row drafts like any other: the quoted document under a regex that allows it (and anything else),
    so the answer is the model's own greedy one, with drafts accepted for it."""
    text, ids = quote_prompt(folder, 1)
    before = counts(server, *DRAFT_COUNTERS)
    rows_before = counter(server, "switchyard_constrained_rows_sum")
    grammar = {"type": "regex", "value": r"[\s\S]{1,2000}"}
    out = generate(server, text, details=True, max_new_tokens=32, grammar=grammar)
    assert [t["id"] for t in out["details"]["tokens"]] == reference_generate(folder, ids, 32)
    drafted, accepted = drafts_since(server, before)
    assert accepted >= 0.5 * drafted > 0, (drafted, accepted)
    assert counter(server, "switchyard_constrained_rows_sum") > rows_before  # it really ran under its grammar


def test_chat_streaming_writes_per_step(server, copy_prompt):
    # /v1/chat/completions streams the copy's multi-token steps as one socket write each, every chunk intact
    text, _ = copy_prompt
    whole = generate(server, text)["generated_text"]
    before = counts(server, *SSE_COUNTERS, role="http")  # earlier streams' counts in
    messages = [{"role": "user", "content": "Repeat this code exactly:\n\n" + TEXT}]
    body = {"messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    lines = [line[6:] for line in r.content.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    chunks = [orjson.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
    now = counts(server, *SSE_COUNTERS, role="http")
    sent, writes = now[0] - before[0], now[1] - before[1]
    assert sent == len(chunks) and 0 < writes < sent, (sent, writes)
