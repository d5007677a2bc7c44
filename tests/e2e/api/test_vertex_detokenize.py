"""vLLM's /detokenize and TGI's /vertex through the real processes on the tiny model: /detokenize gives back the
text /tokenize split (ids outside the vocabulary: a 422); /vertex answers each instance (TGI's generate instance and
a chat request), greedy-equal to /generate with the same seed; no instance is TGI's 422; both are in the served
OpenAPI document."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.e2e

TEXT = "seven wizards quietly hum old songs"


def test_detokenize_inverts_tokenize(tiny_server, tiny_tokenizer):
    tokens = requests.post(tiny_server.url + "/tokenize", json={"inputs": TEXT}, timeout=60).json()
    ids = [t["id"] for t in tokens]
    r = requests.post(tiny_server.url + "/detokenize", json={"tokens": ids}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tiny_tokenizer.decode(ids, skip_special_tokens=False)}
    assert TEXT in r.json()["prompt"]
    r = requests.post(tiny_server.url + "/detokenize", json={"tokens": [5, 10**6]}, timeout=60)
    assert r.status_code == 422 and "out of the vocabulary" in r.json()["error"]
    r = requests.post(tiny_server.url + "/detokenize", json={"tokens": []}, timeout=60)
    assert r.status_code == 200 and r.json() == {"prompt": ""}


def test_vertex_answers_each_instance(tiny_server):
    params = {"max_new_tokens": 6, "seed": 3}
    gen = requests.post(
        tiny_server.url + "/generate", json={"inputs": TEXT, "parameters": {**params, "do_sample": True}}, timeout=60
    )
    assert gen.status_code == 200, gen.text
    chat = {"messages": [{"role": "user", "content": TEXT}], "temperature": 0, "max_tokens": 4}
    chat_answer = requests.post(tiny_server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    body = {"instances": [{"inputs": TEXT, "parameters": params}, chat]}
    r = requests.post(tiny_server.url + "/vertex", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"predictions": [gen.json()["generated_text"], chat_answer["choices"][0]["message"]["content"]]}
    r = requests.post(tiny_server.url + "/vertex", json={"instances": []}, timeout=60)
    assert r.status_code == 422
    assert r.json() == {"error": "Input validation error", "error_type": "Input validation error"}
    # a wrong instance gets its own error (TGI: a 500), not a generation failure; the instance's body is checked
    bad = {"instances": [{"inputs": TEXT, "parameters": {"max_new_tokens": 0}}]}
    r = requests.post(tiny_server.url + "/vertex", json=bad, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    r = requests.post(tiny_server.url + "/vertex", json={"instances": [{"messages": "hi"}]}, timeout=60)
    assert r.status_code == 422 and "deserialize" in r.json()["error"], r.text
    r = requests.post(tiny_server.url + "/vertex", json={"instances": [{"inputs": TEXT}]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1  # the server keeps serving


def test_both_routes_are_documented(tiny_server):
    doc = requests.get(tiny_server.url + "/api-doc/openapi.json", timeout=60).json()
    assert "post" in doc["paths"]["/detokenize"] and "post" in doc["paths"]["/vertex"]
    for name in ("VertexRequest", "VertexInstance", "VertexResponse", "DetokenizeRequest", "DetokenizeResponse"):
        assert name in doc["components"]["schemas"]
