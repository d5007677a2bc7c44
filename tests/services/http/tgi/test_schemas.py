"""Request bodies as TGI's serde reads them: types, nulls, unsigned fields, unknown fields, defaults."""

from __future__ import annotations

import json

import pytest

from tests.services.http.fakes import FakeIngress, client, run

ALL = {
    "best_of": 2,
    "temperature": 0.5,
    "repetition_penalty": 1.2,
    "frequency_penalty": 0.1,
    "top_k": 5,
    "top_p": 0.9,
    "typical_p": 0.8,
    "do_sample": True,
    "max_new_tokens": 7,
    "return_full_text": True,
    "stop": ["\n"],
    "truncate": 10,
    "watermark": True,
    "details": True,
    "decoder_input_details": True,
    "seed": 2**64 - 1,
    "top_n_tokens": 3,
    "grammar": {"type": "json", "value": {"properties": {}}},
    "adapter_id": "lora",
}


async def _send(body: bytes):
    ingress = FakeIngress()
    async with client(ingress) as c:
        r = await c.post("/generate_stream", data=body, headers={"Content-Type": "application/json"})
        return r.status, await r.read(), ingress


def test_every_parameter_reaches_the_wire():
    status, _, ingress = run(_send(json.dumps({"inputs": "x", "parameters": ALL, "unknown": 1}).encode()))
    assert status == 200
    wire = ingress.sent[0].parameters
    for name, value in ALL.items():
        assert getattr(wire, name) == value, name


def test_nullable_parameters_accept_null():
    nullable = [k for k, v in ALL.items() if not isinstance(v, (bool, list))]
    body = {"inputs": "x", "parameters": dict.fromkeys(nullable) | {"extra_field": [1]}}
    status, _, ingress = run(_send(json.dumps(body).encode()))
    assert status == 200 and ingress.sent[0].parameters.best_of is None


@pytest.mark.parametrize(
    "parameters,where",
    [
        ({"do_sample": None}, "do_sample"),
        ({"details": None}, "details"),
        ({"decoder_input_details": None}, "decoder_input_details"),
        ({"watermark": None}, "watermark"),
        ({"stop": None}, "stop"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2**32}, "max_new_tokens"),
        ({"top_n_tokens": -1}, "top_n_tokens"),
        ({"best_of": -1}, "best_of"),
        ({"truncate": -5}, "truncate"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": "x"}, "stop"),
        ({"grammar": {"type": "xml", "value": "a"}}, "grammar"),
    ],
)
def test_wrong_types_are_422_deserialize_errors(parameters, where):
    status, raw, ingress = run(_send(json.dumps({"inputs": "x", "parameters": parameters}).encode()))
    err = json.loads(raw)
    assert status == 422 and err["error_type"] == "validation"
    assert err["error"].startswith("Failed to deserialize the JSON body into the target type: ")
    assert where in err["error"]
    assert ingress.sent == []


@pytest.mark.parametrize(
    "body,status",
    [
        (b'{"inputs": "x",', 400),
        (b'{"parameters": {}}', 422),
        (b'{"inputs": "x", "parameters": null}', 422),
        (b"[1]", 422),
    ],
)
def test_malformed_bodies(body, status):
    code, raw, _ = run(_send(body))
    assert code == status and json.loads(raw)["error_type"] == "validation"


def test_omitted_parameters_sample_empty_parameters_do_not():
    _, _, ingress = run(_send(b'{"inputs": "x"}'))
    assert ingress.sent[0].parameters.do_sample is True
    _, _, ingress = run(_send(b'{"inputs": "x", "parameters": {}}'))
    assert ingress.sent[0].parameters.do_sample is False


def test_traceparent_is_carried():
    async def scenario():
        ingress = FakeIngress()
        async with client(ingress) as c:
            tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            await c.post("/generate", json={"inputs": "x"}, headers={"traceparent": tp})
            return ingress.sent[0].traceparent, tp

    got, sent = run(scenario())
    assert got == sent
