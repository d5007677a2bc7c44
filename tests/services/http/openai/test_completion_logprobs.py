"""/v1/completions with OpenAI's legacy `logprobs`, `echo`, `max_tokens: 0` and token-id prompts, against a scripted
ingress (helpers in tests.services.http.openai.test_routes)."""

from __future__ import annotations

import msgspec
import pytest
from openai.types import Completion

from libs.protocol.messages import TokenText
from services.http.openai import requests as oa
from tests.services.http.openai.test_routes import events, script, serve

PREFILL = [
    TokenText(id=1, text="<bos>", logprob=None, special=True),
    TokenText(id=40, text="one", logprob=-2.0),
    TokenText(id=41, text=" two", logprob=-3.0),
]


def with_prefill(rows, prefill=PREFILL):
    rows[-1].final.prefill = list(prefill)
    return rows


def test_mapping():
    body = msgspec.json.decode(
        b'{"prompt": "a", "logprobs": 2, "echo": true, "max_tokens": 0}', type=oa.CompletionRequest
    )
    p = oa.completion_parameters(body, "m")
    assert (p.top_n_tokens, p.decoder_input_details, p.max_new_tokens) == (2, True, 1)
    assert oa.prompt_only(body)
    body = msgspec.json.decode(
        b'{"prompt": "a", "logprobs": 1, "stream": true, "echo": true}', type=oa.CompletionRequest
    )
    assert not oa.completion_parameters(body, "m").decoder_input_details  # TGI refuses it when streaming
    body = msgspec.json.decode(b'{"prompt": "a", "logprobs": 1}', type=oa.CompletionRequest)
    assert not oa.completion_parameters(body, "m").decoder_input_details
    body = msgspec.json.decode(b'{"prompt": [1, 2], "echo": true}', type=oa.CompletionRequest)
    assert oa.completion_parameters(body, "m").decoder_input_details  # the echo of ids is their texts
    assert oa.CompletionRequest(prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    assert oa.CompletionRequest(prompt=[1, 2]).prompts == [[1, 2]]
    assert oa.CompletionRequest(prompt=["a", "b"]).prompts == ["a", "b"]


@pytest.mark.parametrize("prompt", ['[1, "a"]', "[[1], []]", "[true]", "3", '[["a"]]'])
def test_bad_prompt_shapes(prompt):
    async def test(client, ingress):
        r = await client.post("/v1/completions", data=f'{{"prompt": {prompt}}}')
        assert r.status == 422 and "`$.prompt`" in (await r.json())["error"]
        assert ingress.requests == []

    serve(test)


def test_logprobs_generated():
    async def test(client, ingress):
        ingress.scripts["one"] = script([" 1", " 2"], reason="length", top=2)
        r = await client.post("/v1/completions", json={"prompt": "one", "logprobs": 2, "max_tokens": 2})
        body = await r.json()
        Completion.model_validate(body)
        assert ingress.requests[0].parameters.top_n_tokens == 2
        assert body["choices"][0]["logprobs"] == {
            "tokens": [" 1", " 2"],
            "token_logprobs": [-0.5, -0.5],
            "top_logprobs": [{"alt0": -1.0, "alt1": -2.0, " 1": -0.5}, {"alt0": -1.0, "alt1": -2.0, " 2": -0.5}],
            "text_offset": [0, 2],
        }

    serve(test)


def test_echo_logprobs_and_max_tokens_zero():
    async def test(client, ingress):
        ingress.scripts["one two"] = with_prefill(script([" 3"], reason="length", top=1, input_length=3))
        req = {"prompt": "one two", "logprobs": 1, "echo": True, "max_tokens": 1, "temperature": 0}
        body = await (await client.post("/v1/completions", json=req)).json()
        # (not openai's Completion type: its token_logprobs cannot hold the first prompt token's null, as vLLM's)
        choice = body["choices"][0]
        assert choice["text"] == "one two 3"
        assert choice["logprobs"] == {
            "tokens": ["<bos>", "one", " two", " 3"],
            "token_logprobs": [None, -2.0, -3.0, -0.5],
            "top_logprobs": [None, None, None, {"alt0": -1.0, " 3": -0.5}],
            "text_offset": [0, 0, 3, 7],
        }
        assert ingress.requests[0].parameters.decoder_input_details
        body = await (await client.post("/v1/completions", json={**req, "max_tokens": 0})).json()
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("one two", "length")
        assert choice["logprobs"]["tokens"] == ["<bos>", "one", " two"]
        assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -3.0]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
        assert ingress.requests[1].parameters.max_new_tokens == 1
        body = await (await client.post("/v1/completions", json={**req, "max_tokens": 0, "echo": False})).json()
        assert body["choices"][0]["text"] == "" and body["choices"][0]["logprobs"]["tokens"] == []

    serve(test)


def test_prompt_top_logprobs_are_the_greedy_token_and_the_fed_one():
    async def test(client, ingress):
        rows = with_prefill(script([" 3"], reason="length", input_length=3))
        rows[-1].final.prefill_greedy = [
            None,
            TokenText(id=40, text="one", logprob=-2.0),
            TokenText(id=7, text=" six", logprob=-1.5),
        ]
        ingress.scripts["one two"] = rows
        req = {"prompt": "one two", "logprobs": 1, "echo": True, "max_tokens": 1}
        lp = (await (await client.post("/v1/completions", json=req)).json())["choices"][0]["logprobs"]
        assert lp["top_logprobs"][:3] == [None, {"one": -2.0}, {" six": -1.5, " two": -3.0}]
        # lm-eval's greedy test: the fed token is greedy where its logprob is the position's best
        assert [lp["token_logprobs"][k] == max(lp["top_logprobs"][k].values()) for k in (1, 2)] == [True, False]

    serve(test)


def test_token_id_prompts():
    async def test(client, ingress):
        ingress.scripts[""] = with_prefill(script([" 3"], reason="length", input_length=3))
        req = {"prompt": [[1, 40, 41], [1, 40]], "echo": True, "max_tokens": 1}
        body = await (await client.post("/v1/completions", json=req)).json()
        assert [w.prompt_ids for w in ingress.requests] == [[1, 40, 41], [1, 40]]
        assert all(w.inputs == "" and w.parameters.decoder_input_details for w in ingress.requests)
        assert [c["text"] for c in body["choices"]] == ["one two 3"] * 2  # specials are not in the echo
        assert all(c["logprobs"] is None for c in body["choices"])

    serve(test)


def test_stream_logprobs_of_the_generated_tokens():
    async def test(client, ingress):
        ingress.scripts["one"] = script([" 1", " 2"], reason="length", top=1)
        req = {"prompt": "one", "logprobs": 1, "stream": True, "echo": True}
        r = await client.post("/v1/completions", json=req)
        chunks = [e["choices"][0] for e in events(await r.read()) if e != "[DONE]"]
        assert [c["text"] for c in chunks] == ["one 1", " 2"]
        assert [c["logprobs"] for c in chunks] == [
            {
                "tokens": [" 1"],
                "token_logprobs": [-0.5],
                "top_logprobs": [{"alt0": -1.0, " 1": -0.5}],
                "text_offset": [3],
            },
            {
                "tokens": [" 2"],
                "token_logprobs": [-0.5],
                "top_logprobs": [{"alt0": -1.0, " 2": -0.5}],
                "text_offset": [5],
            },
        ]
        assert not ingress.requests[0].parameters.decoder_input_details  # TGI refuses it when streaming
        r = await client.post("/v1/completions", json={"prompt": "one", "stream": True})
        assert all(e["choices"][0]["logprobs"] is None for e in events(await r.read()) if e != "[DONE]")

    serve(test)
