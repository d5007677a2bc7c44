"""LoRA adapters as the http side sees them: which names a request may use, and vLLM's routes that load and unload
them while serving (docs/lora.md).

The names: the start-up list until the schedulers announce theirs (`AdapterSet` on `lora.`, on every change and
heartbeat), then those every replica serves; a restarted http process starts from the sets the schedulers recorded
in the run directory (services/scheduler/lora.py). OpenAI's `model` names the base model (absent, "tgi", the model
id) or one of them, else vLLM's 404 before anything is generated; TGI's `adapter_id` is the tokenizer's to check.
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` send the change to every replica's scheduler and answer
once each answered, with vLLM's texts and errors (400 bad adapter or name taken, 404 unknown name).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import msgspec
from aiohttp import web

from libs.protocol import topics
from libs.protocol.lora import AdapterDone, AdapterSet, KnownAdapters, LoadAdapter, UnloadAdapter
from libs.runtime.settings import Settings
from services.http.errors import Failure, OpenAIFailure
from services.http.openai import requests as oa

KNOWN = KnownAdapters()  # this process's view of the replicas' adapters
OP_TIMEOUT_S = 300.0  # a replica that answers nothing this long (dead, or loading forever): 503
ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def names(settings: Settings) -> list[str]:
    """The adapters a new request may use now."""
    return KNOWN.names(settings.lora_names)


def seed_from_records(replicas: int, start: list[str], run_dir: str) -> bool:
    """Take each replica's recorded set (`lora-replica-<r>.json`; a replica without one serves `start`) for those
    not announced yet; False (and nothing taken) when nothing was recorded or a record cannot be read."""
    if not run_dir:
        return False
    paths = {r: Path(run_dir) / f"lora-replica-{r}.json" for r in range(replicas)}
    if not any(path.exists() for path in paths.values()):
        return False
    sets = {}
    for r, path in paths.items():
        try:
            sets[r] = [str(entry[0]) for entry in json.loads(path.read_text())["adapters"]]
        except FileNotFoundError:
            sets[r] = list(start)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return False  # the announcements (within a beat) will say
    for r, names in sets.items():
        if r not in KNOWN.by_replica:
            KNOWN.update(AdapterSet(replica=r, names=names))
    return True


def check_model(model: str | None, settings: Settings) -> str | None:
    """The adapter an OpenAI request's `model` names (None: the base model); raises the 404 for an unknown one, in
    OpenAI's shape."""
    name = oa.adapter(model, settings.model_id)
    if name is not None and name not in names(settings):
        # vLLM's text, in OpenAI's shape and code (clients of OpenAI's API match on model_not_found)
        message = f"The model `{model}` does not exist."
        raise OpenAIFailure(message, 404, kind="invalid_request_error", code="model_not_found")
    return name


class _Waiting:
    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.done: dict[int, AdapterDone] = {}
        self.event = asyncio.Event()


_waiting: dict[str, _Waiting] = {}


def on_event(msg: AdapterSet | AdapterDone) -> None:
    """An event from the bus (the ingress reader hands these over)."""
    if isinstance(msg, AdapterSet):
        KNOWN.update(msg)
        return
    w = _waiting.get(msg.op_id)
    if w is not None:
        w.done[msg.replica] = msg
        if len(w.done) >= w.replicas:
            w.event.set()


async def _everywhere(ingress, make, replicas: list[int]) -> dict[int, AdapterDone]:
    """Send one change to each replica's scheduler; every replica's answer."""
    op_id = uuid.uuid4().hex
    w = _waiting[op_id] = _Waiting(len(replicas))
    try:
        for r in replicas:
            await ingress.publish(topics.ctl(r), make(op_id, ingress.index))
        async with asyncio.timeout(OP_TIMEOUT_S):  # not wait_for: see ingress.next_event
            await w.event.wait()
    except TimeoutError:
        silent = sorted(set(replicas) - set(w.done))
        raise Failure(f"replicas {silent} did not answer within {OP_TIMEOUT_S:.0f} s", "unavailable", 503) from None
    finally:
        _waiting.pop(op_id, None)
    return w.done


def _error(message: str, status: int) -> web.Response:
    """vLLM's ErrorResponse."""
    kind = {404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "BadRequestError")
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


async def _body(request: web.Request) -> dict:
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as e:
        raise ValueError(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("The body must be a JSON object.")
    return body


def install(app: web.Application, settings: Settings, ingress) -> None:
    replicas = list(range(max(1, settings.replicas)))
    seed_from_records(len(replicas), settings.lora_names, settings.run_dir)

    async def load(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
        except ValueError as e:
            return _error(str(e), 400)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return _error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        path = os.path.abspath(os.path.expanduser(path))  # the shards' working directory is not ours

        def make(op_id, ingress_index):
            return LoadAdapter(op_id=op_id, ingress=ingress_index, name=name, path=path)

        try:
            done = await _everywhere(ingress, make, replicas)
        except Failure as e:
            return _error(e.message, e.status)
        refused = [d for d in done.values() if d.error]
        if refused:
            loaded = [r for r, d in done.items() if not d.error]
            if loaded:  # all or nothing: the replicas that took it drop it again
                await _everywhere(ingress, _unload_of(name), loaded)
            return _error(refused[0].error, refused[0].status)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
        except ValueError as e:
            return _error(str(e), 400)
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            return _error("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
        try:
            done = await _everywhere(ingress, _unload_of(name), replicas)
        except Failure as e:
            return _error(e.message, e.status)
        refused = [d for d in done.values() if d.error]
        if len(refused) == len(done):  # known nowhere
            return _error(refused[0].error, refused[0].status)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post(ROUTES[0], load)
    app.router.add_post(ROUTES[1], unload)


def _unload_of(name: str):
    def make(op_id, ingress_index):
        return UnloadAdapter(op_id=op_id, ingress=ingress_index, name=name)

    return make
