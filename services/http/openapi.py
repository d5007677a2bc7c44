"""Our own OpenAPI 3.1 document: every route we serve, with the schemas of what it takes and answers.

The schemas are those of the structs in TYPES: the very structs the routes decode and encode (TGI's API in
services.http.tgi.schemas, OpenAI's in services.http.openai.requests and .responses, the errors in
services.http.errors).
JSON Schema comes from msgspec, whose 2020-12 dialect is OpenAPI 3.1's.
"""

from __future__ import annotations

import msgspec

from libs.runtime.settings import Settings
from services.http import errors
from services.http.anthropic import schemas as anthropic
from services.http.middleware import PROTECTED
from services.http.openai import requests as oa
from services.http.openai import responses as oar
from services.http.openai.requests import REF
from services.http.responses_api import events as responses_events
from services.http.responses_api import schemas as responses
from services.http.tgi import schemas as tgi
from services.http.tgi import vertex

TYPES = (
    tgi.GenerateRequest,
    tgi.CompatGenerateRequest,
    tgi.GenerateResponse,
    tgi.StreamResponse,
    tgi.SimpleToken,
    tgi.Info,
    tgi.ModelsInfo,
    oa.ChatRequest,
    oa.ChatMessage,  # the shape of ChatRequest.messages, which pass on as sent
    oa.Tool,  # of ChatRequest.tools, likewise
    oa.CompletionRequest,
    oar.ChatCompletion,
    oar.ChatCompletionChunk,
    oar.ChatCompletionDelta,  # the two shapes of ChatCompletionChunk's delta
    oar.ChatCompletionToolDelta,
    oar.Completion,
    oar.CompletionChunk,
    oar.ChatTokenizeResponse,
    vertex.VertexRequest,
    vertex.VertexInstance,  # of VertexRequest.instances, beside ChatRequest
    vertex.VertexResponse,
    vertex.DetokenizeRequest,
    vertex.DetokenizeResponse,
    errors.ErrorResponse,
    errors.OpenAIStreamError,
    responses.ResponsesRequest,
    responses.Response,
    responses.DeletedResponse,
    responses.OpenAIError,
    responses_events.ResponseEvent,  # the stream's events
    responses_events.OutputItemEvent,
    responses_events.ContentPartEvent,
    responses_events.TextDeltaEvent,
    responses_events.TextDoneEvent,
    responses_events.ReasoningDeltaEvent,
    responses_events.ReasoningDoneEvent,
    responses_events.ArgumentsDeltaEvent,
    responses_events.ArgumentsDoneEvent,
    responses_events.ErrorEvent,
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    anthropic.Message,
    anthropic.TokensCount,
    anthropic.ErrorBody,
)


# ---- paths ------------------------------------------------------------------------------------
def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


def _one_of(*names: str) -> dict:
    return {"oneOf": [_ref(n) for n in names]}


ERROR = {"application/json": {"schema": _ref("ErrorResponse")}}
ERRORS = {
    "400": {"description": "Malformed JSON", "content": ERROR},
    "413": {"description": "Payload too large", "content": ERROR},
    "422": {"description": "Input validation error", "content": ERROR},
    "424": {"description": "Generation error", "content": ERROR},
    "429": {"description": "Model is overloaded", "content": ERROR},
    "500": {"description": "Incomplete generation", "content": ERROR},
    "503": {"description": "No tokenizer is available", "content": ERROR},
}
BODY_ERRORS = {k: ERRORS[k] for k in ("400", "413", "422")}
TIMING_HEADERS = {
    name: {"description": text, "schema": {"type": "string"}}
    for name, text in (
        ("x-compute-type", "COMPUTE_TYPE, or gpu+optimized / cpu"),
        ("x-compute-time", "total seconds"),
        ("x-compute-characters", "characters of the inputs"),
        ("x-total-time", "milliseconds"),
        ("x-validation-time", "milliseconds until the request was placed"),
        ("x-queue-time", "milliseconds from placement to the first token (queue and prefill)"),
        ("x-inference-time", "milliseconds from the first token to the last"),
        ("x-time-per-token", "milliseconds"),
        ("x-prompt-tokens", "prompt tokens"),
        ("x-generated-tokens", "generated tokens"),
    )
}


def _op(op_id: str, summary: str, ok: dict, request: str | dict | None = None, errors: dict | None = None) -> dict:
    op: dict = {"operationId": op_id, "summary": summary, "responses": {"200": ok, **(errors or {})}}
    if request is not None:
        schema = _ref(request) if isinstance(request, str) else request
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return op


def _json(description: str, schema: dict, headers: dict | None = None) -> dict:
    out = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _sse(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"text/event-stream": {"schema": schema}}}


def _both(description: str, json_schema: dict, sse_schema: dict, headers: dict | None = None) -> dict:
    out = _json(description, json_schema, headers)
    out["content"]["text/event-stream"] = {"schema": sse_schema}
    return out


def _paths() -> dict:
    generated_list = {"type": "array", "items": _ref("GenerateResponse")}
    tgi_events = _one_of("StreamResponse", "ErrorResponse")  # errors arrive in-stream, with 200
    chat_events = _one_of("ChatCompletionChunk", "OpenAIStreamError")  # then `data: [DONE]`
    completion_events = _one_of("CompletionChunk", "OpenAIStreamError")
    health = {
        "get": _op(
            "health",
            "200 when every process is alive and the model is loaded",
            {"description": "Healthy (empty body)"},
            errors={"503": {"description": "Unhealthy", "content": ERROR}},
        )
    }
    return {
        "/": {
            "get": {**health["get"], "operationId": "health_root"},
            "post": _op(
                "compat_generate",
                "TGI's compat route: a JSON list, or SSE when `stream` is true",
                _both("Generated text", generated_list, tgi_events, TIMING_HEADERS),
                "CompatGenerateRequest",
                ERRORS,
            ),
        },
        "/generate": {
            "post": _op(
                "generate",
                "Generate tokens",
                _json("Generated text", _ref("GenerateResponse"), TIMING_HEADERS),
                "GenerateRequest",
                ERRORS,
            )
        },
        "/generate_stream": {
            "post": _op(
                "generate_stream",
                "Generate a stream of tokens (Server-Sent Events; errors in-stream)",
                _sse("One event per token; the last carries generated_text", tgi_events),
                "GenerateRequest",
                BODY_ERRORS,
            )
        },
        "/invocations": {
            "post": _op(
                "sagemaker_compatibility",
                "SageMaker: a compat generate, chat or completion body, told apart by its keys",
                _both(
                    "As the route the body belongs to",
                    {"anyOf": [generated_list, _ref("ChatCompletion"), _ref("Completion")]},
                    {"anyOf": [tgi_events, chat_events, completion_events]},
                ),
                _one_of("CompatGenerateRequest", "ChatRequest", "CompletionRequest"),
                ERRORS,
            )
        },
        "/tokenize": {
            "post": _op(
                "tokenize",
                "Tokenize the inputs (byte offsets)",
                _json("Tokens", {"type": "array", "items": _ref("SimpleToken")}),
                "GenerateRequest",
                {**BODY_ERRORS, "503": ERRORS["503"]},
            )
        },
        "/detokenize": {
            "post": _op(
                "detokenize",
                "vLLM's: the text of token ids",
                _json("The text", _ref("DetokenizeResponse")),
                "DetokenizeRequest",
                {**BODY_ERRORS, "503": ERRORS["503"]},
            )
        },
        "/vertex": {
            "post": _op(
                "vertex_compatibility",
                "Vertex AI: every instance generated at once (only max_new_tokens and seed of `parameters` are read)",
                _json("One generated text per instance", _ref("VertexResponse")),
                "VertexRequest",
                ERRORS,
            )
        },
        "/chat_tokenize": {
            "post": _op(
                "chat_tokenize",
                "Render the chat template and tokenize it",
                _json("Tokens and the rendered prompt", _ref("ChatTokenizeResponse")),
                "ChatRequest",
                {**BODY_ERRORS, "503": ERRORS["503"]},
            )
        },
        "/v1/chat/completions": {
            "post": _op(
                "chat_completions",
                "OpenAI chat completions",
                _both("Chat completion, or chunks then `data: [DONE]`", _ref("ChatCompletion"), chat_events),
                "ChatRequest",
                ERRORS,
            )
        },
        "/v1/completions": {
            "post": _op(
                "completions",
                "OpenAI completions",
                _both("Completion, or chunks then `data: [DONE]`", _ref("Completion"), completion_events),
                "CompletionRequest",
                ERRORS,
            )
        },
        **_responses_paths(),
        **_anthropic_paths(),
        "/health": health,
        "/ping": {"get": {**health["get"], "operationId": "ping"}},
        "/info": {"get": _op("get_model_info", "Model and server limits", _json("Info", _ref("Info")))},
        "/v1/models": {"get": _op("openai_get_model_info", "The served model", _json("Models", _ref("ModelsInfo")))},
        **_lora_paths(),
        "/metrics": {
            "get": _op(
                "metrics",
                "Prometheus metrics",
                {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            )
        },
        "/docs": {
            "get": _op(
                "docs",
                "Swagger UI for this document",
                {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}},
            )
        },
        "/api-doc/openapi.json": {
            "get": _op("openapi", "This document", _json("OpenAPI 3.1", {"type": "object"})),
        },
    }


def _responses_paths() -> dict:
    """OpenAI's Responses API (services.http.responses_api): errors in OpenAI's shape."""
    error = {"application/json": {"schema": _ref("OpenAIError")}}
    errors = {
        s: {"description": d, "content": error}
        for s, d in (
            ("400", "Invalid request"),
            ("404", "Unknown model or response id"),
            ("422", "Input validation error"),
            ("429", "Model is overloaded"),
            ("503", "No tokenizer is available"),
        )
    }
    events = {
        "anyOf": [
            _ref(n)
            for n in (
                "ResponseEvent",
                "OutputItemEvent",
                "ContentPartEvent",
                "TextDeltaEvent",
                "TextDoneEvent",
                "ReasoningDeltaEvent",
                "ReasoningDoneEvent",
                "ArgumentsDeltaEvent",
                "ArgumentsDoneEvent",
                "ErrorEvent",
            )
        ]
    }
    path = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    found = {"404": errors["404"]}
    return {
        "/v1/responses": {"post": _op("create_response", "OpenAI's Responses API",
                                      _both("A response, or its events", _ref("Response"), events),
                                      "ResponsesRequest", errors)},
        "/v1/responses/{response_id}": {
            "get": {**_op("get_response", "A stored response", _json("The response", _ref("Response")),
                          errors=found), "parameters": path},
            "delete": {**_op("delete_response", "Forget a stored response",
                             _json("Deleted", _ref("DeletedResponse")), errors=found), "parameters": path},
        },
    }  # fmt: skip


def _anthropic_paths() -> dict:
    """Anthropic's Messages API (services.http.anthropic): errors in Anthropic's shape."""
    error = {"application/json": {"schema": _ref("ErrorBody")}}
    errors = {
        s: {"description": d, "content": error}
        for s, d in (
            ("400", "Invalid request"),
            ("404", "Unknown model"),
            ("422", "Input validation error"),
            ("429", "Model is overloaded"),
            ("503", "No tokenizer is available"),
        )
    }
    events = {
        "type": "object",
        "description": "message_start, ping, content_block_start / _delta / _stop, "
        "message_delta, message_stop, error (Anthropic's stream events)",
    }
    return {
        "/v1/messages": {"post": _op("create_message", "Anthropic's Messages API",
                                     _both("A message, or its events", _ref("Message"), events),
                                     "MessagesRequest", errors)},
        "/v1/messages/count_tokens": {"post": _op("count_message_tokens", "The prompt's token count",
                                                  _json("The count", _ref("TokensCount")), "CountTokensRequest",
                                                  errors)},
    }  # fmt: skip


def _lora_paths() -> dict:
    """vLLM's routes that load and unload LoRA adapters while serving (services.http.lora)."""
    text = {"description": "vLLM's success text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    error = {"content": {"application/json": {"schema": {"type": "object"}}}}  # vLLM's error object
    errors = {"400": {"description": "Bad adapter, or the name is taken", **error}}
    name = {"lora_name": {"type": "string"}}
    path = {"lora_path": {"type": "string"}}
    load = {"type": "object", "required": ["lora_name", "lora_path"], "properties": {**name, **path}}
    unload = {"type": "object", "required": ["lora_name"], "properties": name}
    return {
        "/v1/load_lora_adapter": {"post": _op("load_lora_adapter", "Load a LoRA adapter on every replica", text,
                                              load, errors)},
        "/v1/unload_lora_adapter": {"post": _op("unload_lora_adapter", "Unload a LoRA adapter", text, unload,
                                                {**errors, "404": {"description": "No such adapter", **error}})},
    }  # fmt: skip


def document(settings: Settings, version: str) -> dict:
    """The OpenAPI document of a server run with `settings`."""
    _, components = msgspec.json.schema_components(TYPES, ref_template=REF)
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "Switchyard",
            "description": "Text generation with TGI's HTTP API and OpenAI's chat/completions API",
            "version": version,
        },
        "paths": _paths(),
        "components": {"schemas": components},
    }
    if settings.api_key:  # TGI's protected routes need the key; the rest never do
        doc["components"]["securitySchemes"] = {"BearerAuth": {"type": "http", "scheme": "bearer"}}
        for method, path in PROTECTED:
            op = doc["paths"].get(path, {}).get(method.lower())
            if op is not None:
                op["security"] = [{"BearerAuth": []}]
                op["responses"]["401"] = {"description": "Missing or wrong API key (empty body)"}
    return doc
