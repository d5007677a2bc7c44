"""The tiny test tokenizer (tests/tiny_models.py) in a folder, and a Processor over it with small limits."""

from __future__ import annotations

import pytest

from libs.protocol.messages import GenerateRequest
from libs.protocol.params import Parameters
from libs.runtime.settings import Settings
from services.tokenizer.processor import Processor
from tests.tiny_models import build_tokenizer

# small limits so every length rule is cheap to reach
LIMITS = dict(
    max_input_tokens=20,
    max_total_tokens=30,
    max_stop_sequences=4,
    max_best_of=2,
    max_top_n_tokens=5,
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(folder)  # writes chat_template.jinja too
    return folder


@pytest.fixture(scope="session")
def settings(tiny_dir):
    return Settings(model_path=str(tiny_dir), **LIMITS)


@pytest.fixture(scope="session")
def processor(settings):
    return Processor.from_settings(settings)


def request(
    inputs="hello", *, mode="generate", stream=False, messages=None, tools=None, tool_choice=None, kwargs=None, **params
):
    return GenerateRequest(
        request_id="r" * 32,
        ingress=3,
        inputs=inputs,
        parameters=Parameters(**params),
        add_special_tokens=messages is None,
        mode=mode,
        stream=stream,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        chat_template_kwargs=kwargs,
        traceparent="00-0123456789abcdef0123456789abcdef-0123456789abcdef-01",
    )
