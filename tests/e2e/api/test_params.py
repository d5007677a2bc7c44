"""Each TGI generation parameter has TGI's effect, checked through the real processes against a local
re-computation on the same weights (transformers, float32, eager): the processors and warpers in TGI's order
give exactly the reported logprobs and alternatives; greedy picks their argmax; return_full_text, truncate,
decoder_input_details, max_new_tokens null, seed, best_of and stop sequences do what TGI's do."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tests.e2e.api.test_n_choices import BLOCK, shared_prompt
from tests.e2e.conftest import sse_events
from tests.e2e.test_generate import counter_rises, scheduler_counter
from tests.reference import load_model, reference_generate

pytestmark = pytest.mark.e2e

PROMPT = "seven wizards quietly hum old songs while the quick brown fox jumps"
WATERMARK_GAMMA, WATERMARK_DELTA, WATERMARK_HASH_KEY = 0.5, 2.0, 15485863  # TGI's defaults
TOL = 2e-3  # float32 paged attention against eager: same math, another summation order


def logits_of(model_dir, ids: list[int]) -> torch.Tensor:
    """Raw next-token logits after every position of `ids`."""
    with torch.inference_mode():
        return load_model(str(model_dir))(torch.tensor([ids])).logits[0].float()


def watermark(scores: torch.Tensor, history: list[int]) -> torch.Tensor:
    """Kirchenbauer et al. as TGI: a green list seeded by the previous token gets +delta."""
    rng = torch.Generator().manual_seed(WATERMARK_HASH_KEY * history[-1])
    vocab = scores.shape[-1]
    green = torch.randperm(vocab, generator=rng)[: int(vocab * WATERMARK_GAMMA)]
    scores = scores.clone()
    scores[..., green] += WATERMARK_DELTA
    return scores


def tgi_logprobs(raw: torch.Tensor, history: list[int], p: dict) -> torch.Tensor:
    """TGI's pipeline on one row: watermark, repetition, frequency; temperature, top-k, top-p, typical-p;
    then log_softmax (what TGI reports)."""
    s, ids = raw.clone()[None], torch.tensor([history])
    if p.get("watermark"):
        s = watermark(s, history)
    if p.get("repetition_penalty") not in (None, 1.0):
        s = RepetitionPenaltyLogitsProcessor(p["repetition_penalty"])(ids, s)
    if p.get("frequency_penalty"):
        counts = torch.bincount(ids[0], minlength=s.shape[-1]).float()
        s = s - p["frequency_penalty"] * counts / len(history)
    if p.get("temperature") not in (None, 1.0):
        s = s / p["temperature"]
    if p.get("top_k"):
        s = TopKLogitsWarper(p["top_k"])(ids, s)
    if p.get("top_p") not in (None, 1.0):
        s = TopPLogitsWarper(p["top_p"])(ids, s)
    if p.get("typical_p") not in (None, 1.0):
        s = TypicalLogitsWarper(p["typical_p"])(ids, s)
    return torch.log_softmax(s, -1)[0]


def generate(url: str, inputs: str, **params) -> dict:
    r = requests.post(url + "/generate", json={"inputs": inputs, "parameters": params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


WARPS = [
    ("greedy", {}),
    ("temperature", {"do_sample": True, "temperature": 0.7, "seed": 11}),
    ("top_k", {"do_sample": True, "top_k": 5, "seed": 12}),
    ("top_k=1", {"top_k": 1, "seed": 13}),  # a warper alone means sampling; one survivor: logprob 0
    ("top_p", {"do_sample": True, "top_p": 0.8, "seed": 14}),
    ("typical_p", {"do_sample": True, "typical_p": 0.6, "seed": 15}),
    ("all warpers", {"temperature": 1.3, "top_k": 20, "top_p": 0.9, "typical_p": 0.95, "seed": 16}),
    ("repetition_penalty", {"repetition_penalty": 1.8}),
    ("frequency_penalty", {"frequency_penalty": 1.5}),
    ("watermark", {"watermark": True}),
    ("penalties+sampling", {"do_sample": True, "repetition_penalty": 1.3, "frequency_penalty": -0.5, "seed": 17}),
]
WARPERS = ("temperature", "top_k", "top_p", "typical_p")


@pytest.mark.parametrize("params", [p for _, p in WARPS], ids=[n for n, _ in WARPS])
def test_logprobs_and_top_tokens_follow_tgi_pipeline(tiny_server, tiny_model_dir, tiny_tokenizer, params):
    prompt_ids = tiny_tokenizer(PROMPT).input_ids
    out = generate(tiny_server.url, PROMPT, max_new_tokens=8, details=True, top_n_tokens=3, **params)
    details = out["details"]
    tokens, top = details["tokens"], details["top_tokens"]
    assert len(tokens) == len(top) == details["generated_tokens"] >= 1
    sampling = params.get("do_sample") or any(params.get(w) is not None for w in WARPERS)
    assert details["seed"] == (params["seed"] if sampling else None)
    gen = [t["id"] for t in tokens]
    raw = logits_of(tiny_model_dir, prompt_ids + gen[:-1])[len(prompt_ids) - 1 :]
    for i, tok in enumerate(tokens):
        lp = tgi_logprobs(raw[i], prompt_ids + gen[:i], params)
        assert tok["logprob"] == pytest.approx(lp[tok["id"]].item(), abs=TOL), f"token {i}"
        if not sampling:
            assert tok["id"] == int(lp.argmax()), f"greedy token {i}"
        if params.get("top_k") == 1:
            assert tok["logprob"] == 0.0
        # the alternatives: the best of the same distribution, best first
        finite = int(torch.isfinite(lp).sum())
        alts = [a for a in top[i] if a["logprob"] is not None and a["logprob"] > -1e30]
        assert len(alts) >= min(3, finite), top[i]
        values = [a["logprob"] for a in alts]
        assert values == sorted(values, reverse=True)
        best = lp.topk(min(3, finite)).values.tolist()
        assert values[: len(best)] == pytest.approx(best, abs=TOL)
        for a in alts:
            assert a["logprob"] == pytest.approx(lp[a["id"]].item(), abs=TOL)
        if not sampling:
            assert top[i][0]["id"] == tok["id"]


def test_return_full_text(tiny_server):
    plain = generate(tiny_server.url, PROMPT, max_new_tokens=5)["generated_text"]
    assert generate(tiny_server.url, PROMPT, max_new_tokens=5, return_full_text=True)["generated_text"] == (
        PROMPT + plain
    )
    assert generate(tiny_server.url, PROMPT, max_new_tokens=5, return_full_text=False)["generated_text"] == plain
    # the compat route defaults to true; an explicit false is honoured there too
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}
    assert requests.post(tiny_server.url + "/", json=body).json()[0]["generated_text"] == PROMPT + plain
    body["parameters"]["return_full_text"] = False
    assert requests.post(tiny_server.url + "/", json=body).json()[0]["generated_text"] == plain
    # and on a stream, the final event carries the full text
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "return_full_text": True}}
    events = sse_events(requests.post(tiny_server.url + "/generate_stream", json=body).content)
    assert events[-1]["generated_text"] == PROMPT + plain


def test_truncate_keeps_the_last_tokens(tiny_server, tiny_model_dir, tiny_tokenizer):
    ids, k = tiny_tokenizer(PROMPT).input_ids, 6
    out = generate(tiny_server.url, PROMPT, max_new_tokens=6, truncate=k, details=True, decoder_input_details=True)
    assert [t["id"] for t in out["details"]["prefill"]] == ids[-k:]
    assert [t["id"] for t in out["details"]["tokens"]] == reference_generate(tiny_model_dir, ids[-k:], 6)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "truncate": k, "details": True}}
    events = sse_events(requests.post(tiny_server.url + "/generate_stream", json=body).content)
    assert events[-1]["details"]["input_length"] == k
    # truncate larger than the prompt changes nothing
    long = generate(tiny_server.url, PROMPT, max_new_tokens=6, truncate=300, details=True)
    assert [t["id"] for t in long["details"]["tokens"]] == reference_generate(tiny_model_dir, ids, 6)


def test_decoder_input_details_gives_prompt_logprobs(tiny_server, tiny_model_dir, tiny_tokenizer):
    ids = tiny_tokenizer(PROMPT).input_ids
    out = generate(tiny_server.url, PROMPT, max_new_tokens=2, decoder_input_details=True)
    prefill = out["details"]["prefill"]  # decoder_input_details alone brings `details` (TGI)
    assert [t["id"] for t in prefill] == ids
    assert prefill[0]["logprob"] is None  # nothing predicts the first token
    expected = torch.log_softmax(logits_of(tiny_model_dir, ids), -1)  # raw logits, before any processor
    for i in range(1, len(ids)):
        assert prefill[i]["logprob"] == pytest.approx(expected[i - 1, ids[i]].item(), abs=TOL)
    assert [t["text"] for t in prefill] == [tiny_tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "prefill" in generate(tiny_server.url, PROMPT, max_new_tokens=2, details=True)["details"]


def test_max_new_tokens_null_means_what_is_left(tiny_server, tiny_tokenizer):
    text = "word " * 190  # 381 tokens: 131 left of max_total_tokens 512
    n = len(tiny_tokenizer(text).input_ids)
    details = generate(tiny_server.url, text, max_new_tokens=None, details=True)["details"]
    if details["finish_reason"] == "length":
        assert details["generated_tokens"] == 512 - n
    else:
        assert details["finish_reason"] == "eos_token" and details["generated_tokens"] < 512 - n
    # a max_new_tokens past what is left is refused, not capped (TGI's MaxTotalTokens)
    r = requests.post(tiny_server.url + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": 200}})
    assert r.status_code == 422


SEEDED = {"do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 4242, "max_new_tokens": 12, "details": True}


async def _ids(session, url: str, inputs: str, params: dict, path: str = "/generate") -> list[int]:
    body = {"inputs": inputs, "parameters": params}
    async with session.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        if path == "/generate":
            return [t["id"] for t in (await r.json())["details"]["tokens"]]
        return [e["token"]["id"] for e in sse_events(await r.read())]


def test_seed_repeats_alone_and_inside_a_busy_batch(tiny_server):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            alone = await _ids(s, tiny_server.url, PROMPT, SEEDED)
            # a busy batch: long neighbours (greedy and sampled with other seeds) already decoding
            busy = [
                _ids(s, tiny_server.url, f"{w} the lazy dog", {"max_new_tokens": 60, "details": True, **extra})
                for w, extra in [("one", {}), ("two", {"do_sample": True, "seed": 1}), ("three", {"top_k": 3})]
            ]
            neighbours = [asyncio.create_task(job) for job in busy]
            await asyncio.sleep(0.3)
            twins = await asyncio.gather(*[_ids(s, tiny_server.url, PROMPT, SEEDED) for _ in range(2)])
            streamed = await _ids(s, tiny_server.url, PROMPT, {**SEEDED, "details": False}, "/generate_stream")
            await asyncio.gather(*neighbours)
            return alone, twins, streamed

    alone, twins, streamed = asyncio.run(scenario())
    assert twins == [alone, alone] and streamed == alone
    other = generate(tiny_server.url, PROMPT, **{**SEEDED, "seed": 4243})
    assert [t["id"] for t in other["details"]["tokens"]] != alone


def test_best_of_returns_the_best_by_mean_logprob(tiny_server):
    out = generate(tiny_server.url, PROMPT, max_new_tokens=6, best_of=2, do_sample=True, temperature=1.5, details=True)
    details = out["details"]
    others = details["best_of_sequences"]
    assert len(others) == 1

    def mean(tokens):
        return sum(t["logprob"] for t in tokens) / len(tokens)

    assert mean(details["tokens"]) >= mean(others[0]["tokens"])
    assert others[0]["generated_tokens"] == len(others[0]["tokens"]) and others[0]["finish_reason"]
    assert details["seed"] is not None and others[0]["seed"] is not None and details["seed"] != others[0]["seed"]
    # best_of 1 is a plain request: no best_of_sequences
    assert (
        "best_of_sequences"
        not in generate(tiny_server.url, PROMPT, max_new_tokens=2, best_of=1, details=True)["details"]
    )


def test_best_of_candidates_share_the_prompts_blocks(tiny_server, tiny_tokenizer):
    """best_of's candidates are siblings: the second forks the first's full prompt blocks (the scheduler's
    sibling_shared_tokens counter), and each keeps TGI's details, the prompt's prefill included."""
    p, ids = shared_prompt(tiny_tokenizer)
    before = scheduler_counter(tiny_server.url, "sibling_shared_tokens")
    out = generate(tiny_server.url, p, max_new_tokens=4, best_of=2, do_sample=True, details=True)
    assert len(out["details"]["best_of_sequences"]) == 1
    assert counter_rises(tiny_server.url, "sibling_shared_tokens", before + (len(ids) - 1) // BLOCK * BLOCK - 1)
    scored = generate(
        tiny_server.url, p, max_new_tokens=4, best_of=2, do_sample=True, details=True, decoder_input_details=True
    )
    prefills = [scored["details"]["prefill"], scored["details"]["best_of_sequences"][0]["prefill"]]
    assert prefills[0] == prefills[1] and [t["id"] for t in prefills[0]] == ids


def first_stop(texts: list[str]) -> tuple[int, str]:
    """A token k whose whole text first appears in the output right there: a stop sequence ending at token k."""
    joined = "".join(texts)
    for k in range(1, len(texts)):
        if texts[k].strip() and joined.find(texts[k]) == len("".join(texts[:k])):
            return k, texts[k]
    raise AssertionError(f"no usable stop sequence in {texts!r}")


def test_stop_sequence_is_kept_and_ends_the_stream(tiny_server):
    full = generate(tiny_server.url, PROMPT, max_new_tokens=12, details=True)
    k, stop = first_stop([t["text"] for t in full["details"]["tokens"]])
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True, "stop": [stop, "never seen"]}}
    events = sse_events(requests.post(tiny_server.url + "/generate_stream", json=body).content)
    assert len(events) == k + 1 and events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert events[-1]["generated_text"].endswith(stop)
    out = requests.post(tiny_server.url + "/generate", json=body).json()
    assert out["generated_text"] == events[-1]["generated_text"] and out["details"]["generated_tokens"] == k + 1


def test_timing_and_token_headers(tiny_server, tiny_tokenizer):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}
    r = requests.post(tiny_server.url + "/generate", json=body)
    h = r.headers
    assert h["x-compute-type"] and float(h["x-compute-time"]) >= 0
    assert int(h["x-compute-characters"]) == len(PROMPT)
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(h[name]) >= 0, name
    assert int(h["x-prompt-tokens"]) == len(tiny_tokenizer(PROMPT).input_ids)
    assert int(h["x-generated-tokens"]) == r.json()["details"]["generated_tokens"]
    s = requests.post(tiny_server.url + "/generate_stream", json=body, stream=True)
    with s:
        assert s.headers["x-compute-type"] and int(s.headers["x-compute-characters"]) == len(PROMPT)
        assert s.headers["x-accel-buffering"] == "no"
