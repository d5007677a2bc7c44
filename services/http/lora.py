"""LoRA adapters as the http side sees them: which names a request may use, and vLLM's routes that load and unload
them while serving (docs/lora.md).

The names: the start-up list until the schedulers announce theirs (`AdapterSet` on `lora.`, on every change and
heartbeat), then those every replica serves; a restarted http process starts from the sets the schedulers recorded
in the run directory (services/scheduler/lora.py). OpenAI's `model` names the base model (absent, "tgi", the model
id) or one of them, else vLLM's 404 before anything is generated; TGI's `adapter_id` is the tokenizer's to check.
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` send the change to the scheduler of every replica of the
local model alive now (the live membership, from heartbeats: a replica that joined after start is included, one that
is gone is not waited for) and answer once each answered or went away, with vLLM's texts and errors (400 bad adapter
or name taken, 404 unknown name). A replica that joins after a load, or comes back without it, is sent the load by
the http process that made it (`catch_up`, from the replica's `AdapterSet`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from pathlib import Path

import msgspec
from aiohttp import web

from libs.protocol import topics
from libs.protocol.lora import AdapterDone, AdapterSet, KnownAdapters, LoadAdapter, UnloadAdapter
from libs.runtime.liveness import serving
from libs.runtime.settings import Settings
from services.http.errors import Failure, OpenAIFailure
from services.http.openai import requests as oa

log = logging.getLogger("switchyard.http")
KNOWN = KnownAdapters()  # this process's view of the replicas' adapters
OP_TIMEOUT_S = 300.0  # a replica that answers nothing this long (alive, but loading forever): 503
MEMBERSHIP_CHECK_S = 0.5  # while waiting for answers, how often a replica that went away is let go
CATCH_UP_EVERY_S = 10.0  # a replica still lacking a load we made is sent it again after this long
LOADED: dict[str, str] = {}  # the run-time loads this process made, name → folder: a replica that joins gets them
_catching: dict[str, tuple[int, str]] = {}  # a catch-up load's op id → (replica, name), to log its refusal
_caught: dict[tuple[int, str], float] = {}  # (replica, name) → when its catch-up load was last sent
ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def names(settings: Settings) -> list[str]:
    """The adapters a new request may use now."""
    return KNOWN.names(settings.lora_names)


def members(ingress, model: str) -> list[int]:
    """The replicas of `model` alive now, as this process's heartbeat view has them (the live membership; a replica
    that names no model serves the local one)."""
    return [hb.index for hb in ingress.liveness.alive("scheduler", serving(model, model))]


def seed_from_records(replicas: int, start: list[str], run_dir: str) -> bool:
    """Take each replica's recorded set (`lora-replica-<r>.json`; a replica without one serves `start`) for those
    not announced yet: replicas 0…`replicas`-1 and any other that left a record; False (and nothing taken) when
    nothing was recorded or a record cannot be read."""
    if not run_dir:
        return False
    recorded = {p.stem.removeprefix("lora-replica-") for p in Path(run_dir).glob("lora-replica-*.json")}
    recorded_replicas = {int(r) for r in recorded if r.isdigit()}
    paths = {r: Path(run_dir) / f"lora-replica-{r}.json" for r in sorted(set(range(replicas)) | recorded_replicas)}
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
    def __init__(self) -> None:
        self.done: dict[int, AdapterDone] = {}
        self.event = asyncio.Event()  # set at each answer


_waiting: dict[str, _Waiting] = {}


def on_event(msg: AdapterSet | AdapterDone, ingress=None) -> None:
    """An event from the bus (the ingress reader hands these over, with itself: a catch-up load goes through it)."""
    if isinstance(msg, AdapterSet):
        KNOWN.update(msg)
        if ingress is not None:
            catch_up(msg, ingress)
        return
    w = _waiting.get(msg.op_id)
    if w is not None:
        w.done[msg.replica] = msg
        w.event.set()
    caught = _catching.pop(msg.op_id, None)
    if caught is not None and msg.error:
        log.warning("replica %d refused the LoRA adapter %s it joined without: %s", caught[0], caught[1], msg.error)


def catch_up(announced: AdapterSet, ingress) -> None:
    """A replica announced a set that lacks a run-time load this process made (it joined, or came back, after the
    load): send it that load (again at most every CATCH_UP_EVERY_S while it still lacks it)."""
    now = time.monotonic()
    for name, path in LOADED.items():
        key = (announced.replica, name)
        if name in announced.names or now - _caught.get(key, -CATCH_UP_EVERY_S) < CATCH_UP_EVERY_S:
            continue
        _caught[key] = now
        op_id = uuid.uuid4().hex
        _catching[op_id] = key
        if len(_catching) > 10_000:  # answers that never came (a replica gone meanwhile)
            _catching.pop(next(iter(_catching)))
        log.info("replica %d lacks the LoRA adapter %s: loading it there", announced.replica, name)
        msg = LoadAdapter(op_id=op_id, ingress=ingress.index, name=name, path=path)
        task = asyncio.get_running_loop().create_task(ingress.publish(topics.ctl(announced.replica), msg))
        _sending.add(task)
        task.add_done_callback(_sending.discard)


_sending: set[asyncio.Task] = set()  # catch-up publishes under way (a task nobody holds may be collected)


async def _everywhere(ingress, make, model: str, replicas: list[int] | None = None) -> dict[int, AdapterDone]:
    """Send one change to each replica's scheduler (`replicas`, or every live one of `model`); the answer of each
    that answered. A replica that leaves the live membership before it answers is not waited for."""
    replicas = members(ingress, model) if replicas is None else replicas
    if not replicas:
        raise Failure("No model replica is available", "unavailable", 503)
    op_id = uuid.uuid4().hex
    w = _waiting[op_id] = _Waiting()
    deadline = time.monotonic() + OP_TIMEOUT_S
    try:
        for r in replicas:
            await ingress.publish(topics.ctl(r), make(op_id, ingress.index))
        while waited := [r for r in replicas if r not in w.done and r in members(ingress, model)]:
            if time.monotonic() > deadline:
                raise Failure(f"replicas {waited} did not answer within {OP_TIMEOUT_S:.0f} s", "unavailable", 503)
            w.event.clear()
            try:
                async with asyncio.timeout(MEMBERSHIP_CHECK_S):  # not wait_for: see ingress.next_event
                    await w.event.wait()
            except TimeoutError:
                pass
    finally:
        _waiting.pop(op_id, None)
    gone = sorted(set(replicas) - set(w.done))
    if gone:
        log.info("replicas %s left before they answered a LoRA change: not waited for", gone)
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
    seed_from_records(max(1, settings.replicas), settings.lora_names, settings.run_dir)

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
            done = await _everywhere(ingress, make, settings.model_id)
        except Failure as e:
            return _error(e.message, e.status)
        refused = [d for d in done.values() if d.error]
        if refused or not done:
            loaded = [r for r, d in done.items() if not d.error]
            if loaded:  # all or nothing: the replicas that took it drop it again
                await _everywhere(ingress, _unload_of(name), settings.model_id, loaded)
            if not done:  # every replica left before it answered
                return _error("No model replica is available", 503)
            return _error(refused[0].error, refused[0].status)
        LOADED[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
        except ValueError as e:
            return _error(str(e), 400)
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            return _error("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
        LOADED.pop(name, None)  # a replica that joins from now on is not sent it
        try:
            done = await _everywhere(ingress, _unload_of(name), settings.model_id)
        except Failure as e:
            return _error(e.message, e.status)
        refused = [d for d in done.values() if d.error]
        if not done:  # every replica left before it answered
            return _error("No model replica is available", 503)
        if len(refused) == len(done):  # known nowhere
            return _error(refused[0].error, refused[0].status)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post(ROUTES[0], load)
    app.router.add_post(ROUTES[1], unload)


def _unload_of(name: str):
    def make(op_id, ingress_index):
        return UnloadAdapter(op_id=op_id, ingress=ingress_index, name=name)

    return make
