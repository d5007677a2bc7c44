"""LoRA adapters as the http side sees them: which names a request may use, from the settings the launcher wrote
(the adapters every shard loaded at start; see docs/lora.md).

OpenAI's `model` names the base model (absent, "tgi", or the served model's id) or a loaded adapter. Any other
name is vLLM's 404 "The model `X` does not exist." before anything is generated (TGI would answer from the base
model). TGI's `parameters.adapter_id` is checked by the tokenizer instead (a 422, with the validation errors).
"""

from __future__ import annotations

from libs.runtime.settings import Settings
from services.http import openai_schemas as oa
from services.http.errors import Failure


def check_model(model: str | None, settings: Settings) -> str | None:
    """The adapter an OpenAI request's `model` names (None: the base model); raises the 404 for an unknown one."""
    name = oa.adapter(model, settings.model_id)
    if name is not None and name not in settings.lora_names:
        raise Failure(f"The model `{model}` does not exist.", "not_found", 404)
    return name
