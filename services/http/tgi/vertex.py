"""TGI's /vertex (Vertex AI's prediction shape) and vLLM's /detokenize, beside TGI's /tokenize.

/vertex: `{"instances": [{"inputs", "parameters"?} | a chat request]}` → `{"predictions": [generated text…]}`, every
instance at once. As TGI: of `parameters` only max_new_tokens and seed are taken, sampling and details are forced;
no instance is a 422 "Input validation error"; an instance the server fails a 500 "Incomplete generation". An
instance that is itself wrong (a validation, template or tool error, an overload: a 4xx) is answered with that
error, not TGI's 500, so the client learns what to fix.
/detokenize: `{"tokens": [ids], "model"?}` → `{"prompt": text}` (ids outside the vocabulary: a 422)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web

from libs.protocol.params import Parameters
from services.http.errors import Failure, error_response
from services.http.generation import bus_request
from services.http.models import check_model
from services.http.openai import choices
from services.http.openai import requests as oa
from services.http.responses import json_response
from services.http.tgi.schemas import parse_body


class VertexParameters(msgspec.Struct, kw_only=True):
    """What /vertex reads of TGI's GenerateParameters (the rest is accepted and ignored, as TGI)."""

    max_new_tokens: int | None = None
    seed: int | None = None


class VertexInstance(msgspec.Struct, kw_only=True):
    inputs: str
    parameters: VertexParameters | None = None


# a VertexInstance (`inputs`), or an OpenAI chat request (`messages`)
InstanceObject = Annotated[
    dict[str, Any],
    msgspec.Meta(
        extra_json_schema={
            "anyOf": [{"$ref": oa.REF.format(name="VertexInstance")}, {"$ref": oa.REF.format(name="ChatRequest")}]
        }
    ),
]


class VertexRequest(msgspec.Struct):
    instances: list[InstanceObject]


class VertexResponse(msgspec.Struct):
    predictions: list[str]


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


INVALID = Failure("Input validation error", "Input validation error", 422)
INCOMPLETE = Failure("Incomplete generation", "Incomplete generation", 500)


def _instance_wire(request: web.Request, ingress: int, instance: dict[str, Any], model_id: str):
    """One instance's GenerateRequest (TGI's vertex_compatibility); raises msgspec.ValidationError."""
    if "inputs" in instance:
        inst = msgspec.convert(instance, VertexInstance)
        p = inst.parameters or VertexParameters()
        params = Parameters(
            max_new_tokens=p.max_new_tokens, seed=p.seed, do_sample=True, details=True, return_full_text=False
        )
        return bus_request(request, ingress, params, inputs=inst.inputs)
    chat = msgspec.convert(instance, oa.ChatRequest)
    return bus_request(
        request,
        ingress,
        oa.chat_parameters(chat, model_id),
        inputs="",
        add_special_tokens=False,
        messages=chat.messages,
        tools=chat.tools,
        tool_choice=msgspec.to_builtins(chat.tool_choice),
        tool_prompt=chat.tool_prompt,
        chat_template_kwargs=chat.chat_template_kwargs,
    )


async def vertex(routes, request: web.Request) -> web.Response:
    try:
        body = parse_body(await request.read(), VertexRequest)
        if not body.instances:
            raise INVALID
        try:
            wires = [_instance_wire(request, routes.ingress.index, i, routes.settings.model_id) for i in body.instances]
        except (msgspec.ValidationError, ValueError, TypeError) as e:
            raise Failure(f"Failed to deserialize the JSON body into the target type: {e}", "validation") from None
    except Failure as e:
        return error_response(e)
    try:
        with routes.permits.hold(len(wires)):
            results = await choices.collect_all(routes.ingress, wires, [None] * len(wires))
    except Failure as e:
        return error_response(e if e.status < 500 else INCOMPLETE)
    return json_response(VertexResponse([rows[-1].final.generated_text for rows in results]))


async def detokenize(routes, request: web.Request) -> web.Response:
    """No permit, as /tokenize: the tokenizer decodes the ids (and checks them against the vocabulary)."""
    try:
        body = parse_body(await request.read(), DetokenizeRequest)
        check_model(body.model, routes.settings)
        wire = bus_request(
            request, routes.ingress.index, Parameters(), inputs="", prompt_ids=body.tokens, mode="detokenize"
        )
        result = await routes.ingress.tokenize(wire)
    except Failure as e:
        return error_response(e)
    return json_response(DetokenizeResponse(result.text))
