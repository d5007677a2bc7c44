"""Several models behind one router, as the http side sees them: which model a request is for, where its request
goes, and what `/v1/models` lists.

The served models come from the heartbeats: every live replica's scheduler announces its model and adapters, every
tokenizer its model. A request names a model by OpenAI's or Anthropic's `model` field (it reaches here as the
adapter name the OpenAI layer makes of it; an adapter of another model picks that model), or on any route by the
`X-Gateway-Model-Name` header, the one the Gateway API Inference Extension's body-based routing sets from an OpenAI
body's `model` (TGI's routes have no model field, so a client sets the header itself); a body naming another model
wins over it. Without either, or naming the local model, the default model answers, exactly as with one model:
the request goes through intake to the default model's tokenizers. A request for another model goes, by name, to
one of that model's tokenizers (topic `tokenize.<n>`, round robin).
"""

from __future__ import annotations

from aiohttp import web

from libs.protocol.messages import ChatFormatNote
from libs.protocol.params import Parameters
from libs.runtime.liveness import Liveness, Which, serving
from libs.runtime.settings import Settings
from services.http import lora
from services.http.errors import Failure, OpenAIFailure
from services.http.openai.requests import BASE_MODEL_NAMES

HEADER = "X-Gateway-Model-Name"


class Fleet:
    """The models the live processes announce (empty until an ingress attaches its heartbeat view)."""

    def __init__(self) -> None:
        self.liveness: Liveness | None = None
        self.default = ""  # the local model, --model-id
        self._next = 0  # round robin over a model's tokenizers

    def attach(self, liveness: Liveness, default: str) -> None:
        self.liveness, self.default = liveness, default

    def served(self) -> dict[str, list[str]]:
        """Every model some live replica announces (the default one when announced), with its adapters."""
        models: dict[str, set[str]] = {}
        for hb in self.liveness.alive("scheduler") if self.liveness is not None else []:
            models.setdefault(hb.model or self.default, set()).update(hb.adapters)
        return {name: sorted(adapters) for name, adapters in models.items()}

    def foreign(self, replica: int) -> bool:
        """Whether `replica` serves another model than the local one (known from its heartbeats)."""
        hbs = [hb for hb in self.liveness.alive("scheduler") if hb.index == replica] if self.liveness else []
        return any(hb.model and hb.model != self.default for hb in hbs)

    def other(self, name: str | None) -> bool:
        """Whether `name` is a served model other than the local one."""
        return bool(name) and name != self.default and name in self.served()

    def local_adapter(self, adapter: str) -> bool:
        return adapter in self.served().get(self.default, ())

    def owner(self, adapter: str | None) -> str:
        """The other served model whose replicas announce `adapter` ("": none; the local model's adapters are
        lora.py's)."""
        if not adapter:
            return ""
        return next((m for m, names in self.served().items() if m != self.default and adapter in names), "")

    def of_model(self, model: str) -> Which:
        """Which processes serve `model` ("": the default one, the local model)."""
        return serving(model, self.default)

    def chat_format(self, model: str) -> ChatFormatNote | None:
        """The chat format `model`'s live tokenizers announce (None: none of them does)."""
        hbs = self.liveness.alive("tokenizer", serving(model, self.default)) if self.liveness else []
        return next((hb.chat_format for hb in hbs if hb.chat_format is not None), None)

    def tokenizer_for(self, model: str) -> int | None:
        """A live tokenizer of `model` (round robin), None when it has none."""
        found = [hb.index for hb in self.liveness.alive("tokenizer") if hb.model == model] if self.liveness else []
        if not found:
            return None
        self._next += 1
        return found[self._next % len(found)]


FLEET = Fleet()


def check_model(model: str | None, settings: Settings) -> str | None:
    """OpenAI's check of `model`: another served model passes (None: no adapter); otherwise the local model or one
    of its adapters, else the 404 in OpenAI's shape (lora.check_model)."""
    if FLEET.other(model):
        return None
    if model not in lora.names(settings) and FLEET.owner(model):
        return model
    return lora.check_model(model, settings)


def choose(request: web.Request, parameters: Parameters) -> str:
    """The served model a request is for ("": the default), from the adapter name its `model` field became or, when
    that chose nothing, from the header; an adapter name that is another model is that model's request, with no
    adapter. The header names a model or an adapter, as OpenAI's `model` does (a gateway copies that field into it).
    A header naming nothing served is a 404: OpenAI's shape on the /v1/ routes, TGI's elsewhere."""
    adapter = parameters.adapter_id
    if FLEET.other(adapter):
        parameters.adapter_id = None
        return adapter
    if adapter:  # the body chose: a local adapter, another model's, or one the tokenizer will refuse
        return "" if FLEET.local_adapter(adapter) else FLEET.owner(adapter)
    header = request.headers.get(HEADER, "").strip()
    if header in BASE_MODEL_NAMES or header == FLEET.default:
        return ""
    if FLEET.other(header):
        return header
    if FLEET.local_adapter(header) or FLEET.owner(header):
        parameters.adapter_id = header
        return "" if FLEET.local_adapter(header) else FLEET.owner(header)
    message = f"The model `{header}` does not exist."
    if request.path.startswith("/v1/"):  # the OpenAI-style routes answer as for an unknown `model` field
        raise OpenAIFailure(message, 404, kind="invalid_request_error", code="model_not_found")
    raise Failure(message, "model_not_found", 404)
