"""/v1/completions as lm-evaluation-harness's `local-completions` uses it, through the real processes on the tiny
model: echo + logprobs with max_tokens 0 and 1 give every prompt token's logprob as transformers' float32 eager
log-softmax, tokens and offsets that spell the prompt, the continuation's logprob and greedy alternative; a prompt
given as token ids answers as its text does; bad input is a 422 and the server keeps serving."""

from __future__ import annotations

import pytest
import requests
import torch

from tests.e2e.conftest import sse_events
from tests.reference import load_model

pytestmark = pytest.mark.e2e

PROMPT = "seven wizards quietly hum old songs while the quick brown fox jumps"
TOL = 1e-4


def log_softmax_of(model_dir, ids: list[int]) -> torch.Tensor:
    """log-softmax of the raw next-token logits after every position of `ids` (float32, eager)."""
    with torch.inference_mode():
        return torch.log_softmax(load_model(str(model_dir))(torch.tensor([ids])).logits[0].float(), -1)


def complete(url: str, **body) -> requests.Response:
    return requests.post(url + "/v1/completions", json={"temperature": 0, **body}, timeout=60)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs(tiny_server, tiny_model_dir, tiny_tokenizer, max_tokens):
    ids = tiny_tokenizer(PROMPT).input_ids
    r = complete(tiny_server.url, prompt=PROMPT, max_tokens=max_tokens, logprobs=1, echo=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == n + max_tokens
    assert lp["tokens"][:n] == [tiny_tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = log_softmax_of(tiny_model_dir, ids)
    worst = max(abs(lp["token_logprobs"][i] - expected[i - 1, ids[i]].item()) for i in range(1, n))
    assert worst <= TOL, worst
    for i in range(1, n):  # a prompt position's alternatives: its greedy token (and the fed one)
        best = int(expected[i - 1].argmax())
        top = lp["top_logprobs"][i]
        assert top[tiny_tokenizer.decode([best], skip_special_tokens=False)] == pytest.approx(
            expected[i - 1, best].item(), abs=TOL
        )
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
    # offsets: each non-special prompt token's text is the prompt's text at its offset
    special = set(tiny_tokenizer.all_special_ids)
    for k, i in enumerate(ids):
        if i not in special:
            assert choice["text"][lp["text_offset"][k] :].startswith(lp["tokens"][k])
    assert choice["text"].startswith(PROMPT)
    if max_tokens == 0:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 0
        return
    greedy = int(expected[-1].argmax())
    assert choice["text"] == PROMPT + tiny_tokenizer.decode([greedy])
    assert lp["text_offset"][n] == len(PROMPT)
    assert lp["token_logprobs"][n] == pytest.approx(expected[-1, greedy].item(), abs=TOL)
    top = lp["top_logprobs"][n]
    assert max(top.values()) == lp["token_logprobs"][n]  # lm-eval's is_greedy test on the continuation


def test_continuation_logprob_and_greedy(tiny_server, tiny_model_dir, tiny_tokenizer):
    """lm-eval's loglikelihood: context + continuation, max_tokens 1; sum of the continuation's logprobs."""
    context, continuation = "seven wizards quietly hum", " old songs"
    ids = tiny_tokenizer(context + continuation).input_ids
    ctxlen = len(tiny_tokenizer(context).input_ids)
    r = complete(tiny_server.url, prompt=ids, max_tokens=1, logprobs=1, echo=True)
    lp = r.json()["choices"][0]["logprobs"]
    expected = log_softmax_of(tiny_model_dir, ids)
    want = sum(expected[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(want, abs=1e-3)
    # lm-eval's is_greedy: each continuation token's logprob is the best of its position's top_logprobs
    is_greedy = all(
        t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1])
    )
    assert is_greedy == all(int(expected[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))
    # a continuation that is the model's own greedy text is greedy
    greedy_ids = ids[:ctxlen]
    for _ in range(3):
        greedy_ids.append(int(log_softmax_of(tiny_model_dir, greedy_ids)[-1].argmax()))
    lp = complete(tiny_server.url, prompt=greedy_ids, max_tokens=1, logprobs=1, echo=True).json()["choices"][0][
        "logprobs"
    ]
    assert all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))


def test_id_prompts_equal_text(tiny_server, tiny_tokenizer):
    texts = [PROMPT, "the quick brown fox"]
    ids = [tiny_tokenizer(t).input_ids for t in texts]
    by_text = complete(tiny_server.url, prompt=texts, max_tokens=4, logprobs=2, echo=True).json()
    by_ids = complete(tiny_server.url, prompt=ids, max_tokens=4, logprobs=2, echo=True).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    for a, b in zip(by_ids["choices"], by_text["choices"]):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=TOL)
    one = complete(tiny_server.url, prompt=ids[0], max_tokens=4).json()
    assert one["choices"][0]["text"] == by_text["choices"][0]["text"][len(PROMPT) :]
    assert by_ids["usage"] == by_text["usage"]


def test_stream_logprobs_equal_the_answer(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2}
    whole = complete(tiny_server.url, **body).json()["choices"][0]["logprobs"]
    r = requests.post(tiny_server.url + "/v1/completions", json={**body, "temperature": 0, "stream": True}, timeout=60)
    chunks = [e["choices"][0]["logprobs"] for e in sse_events(r.content) if e != "[DONE]"]
    streamed = {k: [v for c in chunks for v in c[k]] for k in whole}
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=TOL)


def test_bad_input_is_a_422(tiny_server, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    for body in (
        {"prompt": [1, vocab + 10], "max_tokens": 1},
        {"prompt": "word " * 450, "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": PROMPT, "max_tokens": 1, "logprobs": 6},
        {"prompt": [1, "a"], "max_tokens": 1},
    ):
        r = complete(tiny_server.url, **body)
        assert r.status_code == 422, (body, r.text)
        assert set(r.json()) == {"error", "error_type"}
    assert complete(tiny_server.url, prompt=PROMPT, max_tokens=1).status_code == 200
