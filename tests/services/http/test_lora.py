"""LoRA adapters on the http side: OpenAI's `model` resolved against the loaded adapters (vLLM's 404 for an unknown
one in OpenAI's error shape, before any generation), /v1/models in vLLM's shape, /info naming the loaded adapters."""

import json

from tests.services.http.fakes import FakeIngress, client, run
from tests.services.http.openai.test_routes import MSG, SETTINGS, script, serve

LOADED = SETTINGS.replace(lora_adapters="a=/adapters/a,org/b=/adapters/b")


def test_unknown_model_is_a_404_on_both_openai_routes():
    async def test(client, ingress):
        ingress.scripts["*"] = script(["x"], reason="length", special_last=False)
        for path, body in [("/v1/chat/completions", MSG), ("/v1/completions", {"prompt": "hi"})]:
            for stream in (False, True):
                r = await client.post(path, json={**body, "model": "nope", "stream": stream})
                assert r.status == 404, (path, stream)
                assert await r.json() == {  # OpenAI's shape and code
                    "error": {
                        "message": "The model `nope` does not exist.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "model_not_found",
                    }
                }
            for model in ("a", "org/b", "tgi", SETTINGS.model_id, None):
                r = await client.post(path, json={**body, "model": model})
                assert r.status == 200, (path, model, await r.text())
        # only the known ones reached the bus, each with its adapter (None: the base model)
        adapters = [wire.parameters.adapter_id for wire in ingress.requests]
        assert adapters == ["a", "org/b", None, None, None] * 2

    serve(test, settings=LOADED)


def test_models_and_info_list_the_adapters():
    async def scenario():
        async with client(FakeIngress(), lora_adapters="a=/adapters/a,org/b=/adapters/b") as c:
            return [json.loads(await (await c.get(path)).read()) for path in ("/v1/models", "/info")]

    models, info = run(scenario())
    assert models["data"] == [
        {"id": "org/tiny", "object": "model", "created": 0, "owned_by": "org/tiny"},
        {"id": "a", "object": "model", "created": 0, "owned_by": "org/tiny", "parent": "org/tiny"},
        {"id": "org/b", "object": "model", "created": 0, "owned_by": "org/tiny", "parent": "org/tiny"},
    ]
    assert info["lora_adapters"] == ["a", "org/b"]
