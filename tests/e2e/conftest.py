"""Real servers for the end-to-end tests: one on a tiny test model, one on the tiny model with the API's special
flags (api key, payload limit, 2 concurrent requests, CORS, chat template). The embedded models' servers are
their tests' own (test_gemma.py: Gemma-3-270M by name; test_quickstart.py: the default model)."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from tests.e2e.server import Server
from tests.tiny_models import build_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tiny-server.log"
    # small limits so the length checks are cheap to reach
    # a short stall timeout, for test_health's hung shard (a tiny-model step takes milliseconds)
    with Server(
        tiny_model_dir, log, "--max-total-tokens", "512", "--max-input-tokens", "400", "--shard-stall-timeout", "6"
    ) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def pressed_server(tiny_model_dir, tmp_path_factory):
    """The tiny model under pressure: a KV cache of 20 blocks of 16 (preemption by recompute) and a prefill budget of
    100 tokens (chunked prefill), for test_kv_pressure.py and test_structured_output.py."""
    log = tmp_path_factory.mktemp("logs") / "pressed-server.log"
    flags = ["--max-total-tokens", "256", "--max-input-tokens", "100", "--max-batch-prefill-tokens", "100"]
    with Server(tiny_model_dir, log, *flags, "--max-batch-total-tokens", "320") as server:
        yield server


# --------------------------------------------------------------------------------------------
# The server with the special flags (tests/e2e/api/test_limits.py)

API_KEY = "Sw1tchyard-Secret"
PAYLOAD_LIMIT = 4096
MAX_CONCURRENT = 2
ALLOWED_ORIGIN = "https://allowed.example"
# A template of our own (not the model's): [role] lines, and a raise_exception for `tool` messages, so the
# override and template errors are both visible.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported here') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def limits_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "limits-server.log"
    flags = [
        *("--max-total-tokens", "512", "--max-input-tokens", "400"),
        *("--api-key", API_KEY, "--payload-limit", str(PAYLOAD_LIMIT)),
        *("--max-concurrent-requests", str(MAX_CONCURRENT), "--cors-allow-origin", ALLOWED_ORIGIN),
        *("--chat-template", CHAT_TEMPLATE),
    ]
    with Server(tiny_model_dir, log, *flags, clean_log=False) as server:  # the tests provoke errors on purpose
        yield server


# --------------------------------------------------------------------------------------------
# Shared helpers


def sse_events(body: bytes | str) -> list:
    """The `data:` payloads of an SSE body, in order: JSON objects, or the string "[DONE]"."""
    text = body.decode() if isinstance(body, bytes) else body
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


RENDERED = re.compile(r'^switchyard_metrics_rendered_timestamp_seconds\{index="(\d+)",role="(\w+)"\} (\S+)$', re.M)


def fresh_metrics(url: str, roles: tuple[str, ...] | None = None, timeout: float = 30.0) -> str:
    """/metrics text in which every process of `roles` (None: every process) is read from a render made after this
    call began: renders are paced, so a counter may lag its event by up to two heartbeats."""
    began, deadline = time.time(), time.monotonic() + timeout
    while True:
        text = requests.get(url + "/metrics", timeout=10).text
        stamps = {(role, int(i)): float(t) for i, role, t in RENDERED.findall(text)}
        watched = {k: t for k, t in stamps.items() if roles is None or k[0] in roles}
        if watched and min(watched.values()) >= began:
            return text
        assert time.monotonic() < deadline, ("no render since", began, roles, stamps)
        time.sleep(0.1)


class OpenAPI:
    """Our server's own OpenAPI document: checks a response body against the schema it declares for
    (path, method, status, content type), resolving every $ref inside the document."""

    URI = "urn:switchyard:openapi"

    def __init__(self, doc: dict):
        from openapi_schema_validator import OAS30Validator, OAS31Validator
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        self.doc = doc
        self.validator = OAS31Validator if str(doc.get("openapi", "")).startswith("3.1") else OAS30Validator
        resource = Resource.from_contents(doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(self.URI, resource)

    def _follow(self, pointer: list[str]) -> tuple[list[str], dict]:
        """The node at `pointer`, following a `$ref` (within the document) on the way; and its real pointer."""
        node = self.doc
        for i, part in enumerate(pointer):
            node = node[part]
            if isinstance(node, dict) and "$ref" in node:
                ref = node["$ref"]
                assert ref.startswith("#/"), ref
                target = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
                return self._follow(target + pointer[i + 1 :])
        return pointer, node

    def schema_pointer(self, path: str, method: str, status: int, content_type: str) -> str:
        op = self.doc["paths"][path][method.lower()]
        key = str(status) if str(status) in op["responses"] else "default"
        assert key in op["responses"], f"{method} {path}: no response {status} in the document"
        base = ["paths", path, method.lower(), "responses", key]
        real, response = self._follow(base)  # a response may be a $ref to components/responses
        content = response.get("content", {})
        assert content_type in content, f"{method} {path} {status}: no {content_type} content in {list(content)}"
        pointer = real + ["content", content_type, "schema"]
        return "/".join(p.replace("~", "~0").replace("/", "~1") for p in pointer)

    def check(self, path: str, method: str, status: int, body, content_type: str = "application/json") -> None:
        pointer = self.schema_pointer(path, method, status, content_type)
        validator = self.validator({"$ref": f"{self.URI}#/{pointer}"}, registry=self.registry)
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
        assert not errors, f"{method} {path} {status}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


@pytest.fixture(scope="session")
def openapi(tiny_server) -> OpenAPI:
    r = requests.get(tiny_server.url + "/api-doc/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    return OpenAPI(r.json())
