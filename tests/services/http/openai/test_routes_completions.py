"""/v1/completions over HTTP, against a scripted ingress (helpers in tests.services.http.openai.test_routes)."""

from __future__ import annotations

import asyncio
import math

from openai.types import Completion

from libs.protocol.messages import TextRow
from services.http.errors import Failure
from tests.services.http.openai.test_routes import MODEL, events, script, serve


# ---- completions --------------------------------------------------------------------------------
def test_completions_non_stream():
    async def test(client, ingress):
        ingress.scripts["one"] = script([" 1", " 2"], reason="length", special_last=False, input_length=2)
        ingress.scripts["two"] = script([" a", "</s>"], input_length=3)
        r = await client.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 2})
        body = await r.json()
        parsed = Completion.model_validate(body)
        assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
            (0, " 1 2", "length"),
            (1, " a", "stop"),
        ]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
        # TGI adds up each prompt's headers
        assert (r.headers["x-prompt-tokens"], r.headers["x-generated-tokens"]) == ("5", "4")
        assert r.headers["x-compute-characters"] == "6"
        assert (body["id"], body["model"], body["object"]) == ("", MODEL, "text_completion")
        assert all(c["logprobs"] is None for c in body["choices"])
        assert [w.inputs for w in ingress.requests] == ["one", "two"]
        assert all(w.add_special_tokens and w.messages is None for w in ingress.requests)
        body = await (await client.post("/v1/completions", json={"prompt": "one", "echo": True})).json()
        assert body["choices"][0]["text"] == "one 1 2"

    serve(test)


def test_completions_refusals():
    async def test(client, ingress):
        r = await client.post("/v1/completions", json={"prompt": "a", "suffix": "z"})
        assert r.status == 422
        assert await r.json() == {
            "error": "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "error_type": "suffix not supported",
        }
        r = await client.post("/v1/completions", json={"prompt": ["a"] * 4, "stream": True})
        assert r.status == 422
        assert await r.json() == {
            "error": "Number of prompts exceeds the maximum allowed batch size of 3",
            "error_type": "batch size exceeded",
        }
        ingress.scripts["*"] = Failure("Input validation error: `inputs` cannot be empty", "validation")
        r = await client.post("/v1/completions", json={"prompt": ""})
        assert r.status == 422 and (await r.json())["error_type"] == "validation"
        assert ingress.requests[0].inputs == ""  # only the last one reached the ingress

    serve(test)


def test_completions_need_one_permit_per_prompt():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["a"])
        assert (await client.post("/v1/completions", json={"prompt": ["a", "b"]})).status == 200
        r = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
        assert r.status == 429 and not any(w.inputs == "c" for w in ingress.requests)

    serve(test, limit=2)


def test_completions_stream_interleaved():
    async def test(client, ingress):
        ingress.scripts["one"] = script([" 1", " 2", " 3"], reason="length", special_last=False, input_length=2)
        ingress.scripts["two"] = script([" a", "</s>"], input_length=3)
        req = {"prompt": ["one", "two"], "stream": True, "echo": True}
        evs = events(await (await client.post("/v1/completions", json=req)).read())
        assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
        by_prompt = {0: [], 1: []}
        for e in evs[:-1]:
            assert e["object"] == "text_completion" and e["id"] == "" and e["model"] == MODEL
            (choice,) = e["choices"]
            by_prompt[choice["index"]].append(e)
        assert [e["choices"][0]["text"] for e in by_prompt[0]] == ["one 1", " 2", " 3"]
        assert [e["choices"][0]["text"] for e in by_prompt[1]] == ["two a", "</s>"]
        # TGI: "" until the last chunk, which keeps the native finish reason and has the usage
        assert [e["choices"][0]["finish_reason"] for e in by_prompt[1]] == ["", "eos_token"]
        assert "usage" not in by_prompt[1][0]
        assert by_prompt[0][-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        indices = [e["choices"][0]["index"] for e in evs[:-1]]
        assert indices != sorted(indices)  # the prompts' tokens interleave
        for e in evs[:-1]:
            Completion.model_construct(**e)

    serve(test)


def test_completions_stream_error_in_stream():
    async def test(client, ingress):
        ingress.scripts["ok"] = script(["x"])
        ingress.scripts["bad"] = Failure("Input validation error: `top_p` must be > 0.0 and < 1.0", "validation")
        evs = events(
            await (await client.post("/v1/completions", json={"prompt": ["ok", "bad"], "stream": True})).read()
        )
        assert {"error": {"message": ingress.scripts["bad"].message, "http_status_code": 422}} in evs
        assert evs[-1] == "[DONE]" and len(evs) == 3

    serve(test)


def test_client_disconnect_closes_the_stream():
    async def test(client, ingress):
        async def endless(req, timing=None):
            ingress.requests.append(req)
            try:
                i = 0
                while True:
                    i += 1
                    yield TextRow(request_id="r", index=i, token_id=1, text="x", logprob=-math.inf, special=False)
                    await asyncio.sleep(0.01)
            finally:
                ingress.closed.append(req.request_id)

        ingress.generate = endless
        r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True})
        await r.content.readline()
        r.close()
        for _ in range(100):
            if len(ingress.closed) == 2:
                break
            await asyncio.sleep(0.02)
        assert sorted(ingress.closed) == sorted(w.request_id for w in ingress.requests)

    serve(test)
