"""The OpenAI / vLLM sampling parameters (min_p, logit_bias, ignore_eos, min_tokens, stop_token_ids) through the
real processes on the tiny model, against transformers' own processors on the same weights (float32, eager):
greedy continuations are recomputed token by token with SequenceBiasLogitsProcessor and
MinNewTokensLengthLogitsProcessor, a seeded min_p answer's logprobs with MinPLogitsWarper. Bad values are a 422 in
the OpenAI routes' error shape, and TGI's /generate is unchanged."""

from __future__ import annotations

import pytest
import requests
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from tests.reference import load_model
from tests.tiny_models import EOS

pytestmark = pytest.mark.e2e

PROMPT = "seven wizards quietly hum old songs while the quick brown fox jumps"
TOL = 2e-3  # float32 paged attention against eager: same math, another summation order


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def greedy(model, prompt_ids: list[int], n: int, processors: LogitsProcessorList, stop: set[int]) -> list[int]:
    """transformers' greedy loop with `processors`, one full forward per token; ends after a token in `stop`."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            token = int(processors(torch.tensor([ids]), logits).argmax())
            ids.append(token)
            if token in stop:
                break
    return ids[len(prompt_ids) :]


def complete(url: str, **fields) -> dict:
    r = requests.post(url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text(tokenizer, ids: list[int]) -> str:
    """The ids' text as the server streams it: special tokens and incomplete UTF-8 left out."""
    return tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")


def bias(mapping: dict[int, float]) -> SequenceBiasLogitsProcessor:
    return SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in mapping.items()])


def test_logit_bias_plus_100_forces_a_token(tiny_server, tiny_tokenizer, model):
    prompt_ids = tiny_tokenizer(PROMPT).input_ids
    forced = 500
    want = greedy(model, prompt_ids, 4, LogitsProcessorList([bias({forced: 100.0})]), {EOS})
    assert want == [forced] * 4
    out = complete(tiny_server.url, max_tokens=4, logit_bias={str(forced): 100})
    assert out["choices"][0]["text"] == text(tiny_tokenizer, want)
    assert out["choices"][0]["finish_reason"] == "length"


def test_logit_bias_minus_100_bans_the_greedy_token(tiny_server, tiny_tokenizer, model):
    prompt_ids = tiny_tokenizer(PROMPT).input_ids
    plain = greedy(model, prompt_ids, 6, LogitsProcessorList(), {EOS})
    banned = plain[0]
    want = greedy(model, prompt_ids, 6, LogitsProcessorList([bias({banned: -100.0})]), {EOS})
    assert banned not in want
    out = complete(tiny_server.url, max_tokens=6, logit_bias={str(banned): -100})
    assert out["choices"][0]["text"] == text(tiny_tokenizer, want)
    assert out["usage"]["completion_tokens"] == len(want)


def test_chat_logit_bias_map_and_tgi_array(tiny_server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 3}
    r = requests.post(tiny_server.url + "/v1/chat/completions", json={**body, "logit_bias": {"500": 100}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    forced = r.json()["choices"][0]["message"]["content"]
    r = requests.post(tiny_server.url + "/v1/chat/completions", json={**body, "logit_bias": [0.5]}, timeout=60)
    assert r.status_code == 200, r.text  # TGI's array: accepted and ignored
    assert r.json()["choices"][0]["message"]["content"] != forced


def test_ignore_eos_runs_to_max_tokens_past_eos(tiny_server):
    # EOS forced by the bias: without ignore_eos it ends at once, with it the answer runs to max_tokens
    out = complete(tiny_server.url, max_tokens=5, logit_bias={str(EOS): 100})
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (1, "stop")
    out = complete(tiny_server.url, max_tokens=5, logit_bias={str(EOS): 100}, ignore_eos=True)
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (5, "length")


def test_min_tokens_holds_eos_back(tiny_server, tiny_tokenizer, model):
    prompt_ids, k = tiny_tokenizer(PROMPT).input_ids, 3
    chain = LogitsProcessorList(
        [bias({EOS: 100.0}), MinNewTokensLengthLogitsProcessor(len(prompt_ids), k, eos_token_id=[EOS])]
    )
    want = greedy(model, prompt_ids, 10, chain, {EOS})
    assert len(want) == k + 1 and want[-1] == EOS and EOS not in want[:-1]
    out = complete(tiny_server.url, max_tokens=10, logit_bias={str(EOS): 100}, min_tokens=k)
    assert out["choices"][0]["text"] == text(tiny_tokenizer, want)
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (k + 1, "stop")


def stop_ends_at(texts: list[str], stop: str, first: int) -> int | None:
    """The detokenizer's rule: the count of tokens at which `stop` first ends inside a token's text, from token
    `first` on (a stop lying wholly in earlier text is not found again)."""
    for n in range(max(first, 1), len(texts) + 1):
        done, now = "".join(texts[: n - 1]), "".join(texts[:n])
        if (pos := now.find(stop, max(0, len(done) - len(stop) + 1))) >= 0 and pos + len(stop) > len(done):
            return n
    return None


def test_min_tokens_holds_stop_strings_back(tiny_server, tiny_tokenizer, model):
    """vLLM's rule: a stop string counts only once the answer has min_tokens tokens."""
    prompt_ids, k, m = tiny_tokenizer(PROMPT).input_ids, 3, 12
    plain = greedy(model, prompt_ids, m, LogitsProcessorList(), set())
    texts = [tiny_tokenizer.decode([t]) for t in plain]
    # a character of the first token's text that ends inside a later token again, from token k on
    stop, at = next((c, n) for c in texts[0].strip() if (n := stop_ends_at(texts, c, k)) is not None)
    early = complete(tiny_server.url, max_tokens=m, stop=[stop])
    reason = early["choices"][0]["finish_reason"]  # the route's name for a stop string (as TGI's)
    assert (early["usage"]["completion_tokens"], reason) == (1, "stop_sequence")
    held = complete(tiny_server.url, max_tokens=m, stop=[stop], min_tokens=k)
    assert (held["usage"]["completion_tokens"], held["choices"][0]["finish_reason"]) == (at, reason)
    assert at > k - 1 and held["choices"][0]["text"].startswith(text(tiny_tokenizer, plain[: at - 1]))


def test_stop_token_ids_end_with_stop(tiny_server, tiny_tokenizer, model):
    prompt_ids = tiny_tokenizer(PROMPT).input_ids
    plain = greedy(model, prompt_ids, 8, LogitsProcessorList(), {EOS})
    at = next(i for i, t in enumerate(plain) if t not in plain[:i] and t != EOS and i >= 1)
    out = complete(tiny_server.url, max_tokens=8, stop_token_ids=[plain[at]])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == at + 1
    assert out["choices"][0]["text"] == text(tiny_tokenizer, plain[: at + 1])


def test_min_p_seeded_answer_follows_the_warper(tiny_server, tiny_tokenizer, model):
    """Each sampled token lies inside MinPLogitsWarper's kept set and its logprob is transformers' log-softmax of
    the warped scores (temperature, then min_p: transformers' order)."""
    messages = [{"role": "user", "content": PROMPT}]
    body = dict(messages=messages, temperature=1.5, min_p=0.2, seed=7, max_tokens=8, logprobs=True, top_logprobs=3)
    r = requests.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["logprobs"]["content"]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tiny_tokenizer(rendered, add_special_tokens=False).input_ids
    chain = LogitsProcessorList([TemperatureLogitsWarper(1.5), MinPLogitsWarper(0.2)])
    cut = False
    with torch.inference_mode():
        for i, row in enumerate(rows):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            lp = torch.log_softmax(chain(torch.tensor([ids]), logits), -1)[0]
            cut |= bool(torch.isinf(lp).any())
            kept = [t for t in torch.nonzero(torch.isfinite(lp))[:, 0].tolist()]
            match = [t for t in kept if abs(lp[t].item() - row["logprob"]) <= TOL]
            if len(match) > 1:  # the same logprob twice: the token's text tells them apart
                match = [t for t in match if text(tiny_tokenizer, [t]) == row["token"].replace("\ufffd", "")]
            assert match, f"token {i}: {row} is no token min_p keeps"
            for alt in row["top_logprobs"]:
                if alt["logprob"] is not None and alt["logprob"] > -1e30:
                    assert any(abs(lp[t].item() - alt["logprob"]) <= TOL for t in kept), alt
            ids.append(match[0])
    assert cut  # min_p really removed tokens here


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
        ({"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {"100000": 1}}, "in logit_bias contain out-of-vocab token ids"),
        ({"stop_token_ids": [100000]}, "in stop_token_ids contain out-of-vocab token ids"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be less than or equal to max_tokens=4, got 5."),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_422_and_the_server_serves_on(tiny_server, route, fields, words):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(tiny_server.url + route, json={**body, "max_tokens": 2, **fields}, timeout=60)
    assert r.status_code == 422, r.text
    assert words in r.json()["error"] and r.json()["error_type"] == "validation"
    assert complete(tiny_server.url, max_tokens=2)["usage"]["completion_tokens"] == 2


def test_generate_is_unchanged(tiny_server):
    r = requests.post(tiny_server.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}
    schema = requests.get(tiny_server.url + "/api-doc/openapi.json").json()["components"]["schemas"]
    assert not {"min_p", "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids"} & set(
        schema["GenerateParameters"]["properties"]
    )
