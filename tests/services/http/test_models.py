"""Which served model a request is for (services/http/models.py), from the heartbeats of a fleet with two models:
the header or the OpenAI `model` (as the adapter name it becomes) picks another served model, nothing or the local
model is the default (""), an unknown one is a 404 in the route's shape; a model's requests go to its own
tokenizers, round robin."""

from __future__ import annotations

import os

import pytest
from aiohttp.test_utils import make_mocked_request

from libs.protocol.messages import Heartbeat
from libs.protocol.params import Parameters
from libs.runtime.liveness import Liveness
from libs.runtime.settings import Settings
from services.http import models
from services.http.errors import Failure, OpenAIFailure

LOCAL, OTHER = "model-a", "model-b"


def beat(role: str, index: int, **kw) -> Heartbeat:
    return Heartbeat(role=role, index=index, pid=os.getpid(), **kw)


@pytest.fixture
def fleet(monkeypatch):
    liveness = Liveness()
    for hb in (
        beat("scheduler", 0, model=LOCAL, adapters=["a-lora"]),
        beat("scheduler", 1, model=OTHER, adapters=["b-lora"]),
        beat("tokenizer", 0, model=LOCAL),
        beat("tokenizer", 1, model=OTHER),
        beat("tokenizer", 2, model=OTHER),
    ):
        liveness.record(hb)
    fleet = models.Fleet()
    fleet.attach(liveness, LOCAL)
    monkeypatch.setattr(models, "FLEET", fleet)
    return fleet


def choose(headers: dict | None = None, adapter: str | None = None) -> tuple[str, str | None]:
    parameters = Parameters(adapter_id=adapter)
    model = models.choose(make_mocked_request("POST", "/generate", headers=headers or {}), parameters)
    return model, parameters.adapter_id


def test_the_header_or_the_model_field_picks_a_served_model(fleet):
    assert fleet.served() == {LOCAL: ["a-lora"], OTHER: ["b-lora"]}
    assert choose() == ("", None)  # nothing chosen: the default model, as with one model
    assert choose({models.HEADER: LOCAL}) == choose({models.HEADER: "tgi"}) == ("", None)
    assert choose({models.HEADER: OTHER}) == (OTHER, None)
    assert choose(adapter=OTHER) == (OTHER, None)  # OpenAI's `model: "model-b"`: the model, no adapter
    assert choose(adapter="b-lora") == (OTHER, "b-lora")  # an adapter of the other model picks that model
    assert choose({models.HEADER: LOCAL}, adapter=OTHER) == (OTHER, None)  # the body's choice wins
    assert choose({models.HEADER: "b-lora"}) == (OTHER, "b-lora")  # the header names an adapter as `model` does
    assert choose({models.HEADER: "a-lora"}) == ("", "a-lora")
    assert choose({models.HEADER: "a-lora"}, adapter="a-lora") == ("", "a-lora")  # a gateway's copy of the body
    with pytest.raises(Failure) as e:
        choose({models.HEADER: "model-c"})
    assert (e.value.status, e.value.error_type) == (404, "model_not_found") and not isinstance(e.value, OpenAIFailure)
    with pytest.raises(OpenAIFailure) as e:
        models.choose(make_mocked_request("POST", "/v1/completions", headers={models.HEADER: "c"}), Parameters())
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_the_openai_check_passes_served_models_and_refuses_others(fleet):
    settings = Settings(model_id=LOCAL)
    assert models.check_model(OTHER, settings) is None
    assert models.check_model("b-lora", settings) == "b-lora"
    assert models.check_model(LOCAL, settings) is None and models.check_model(None, settings) is None
    with pytest.raises(OpenAIFailure) as e:
        models.check_model("model-c", settings)
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_a_models_requests_go_to_its_own_tokenizers_in_turn(fleet):
    assert sorted({fleet.tokenizer_for(OTHER) for _ in range(4)}) == [1, 2]
    assert fleet.tokenizer_for(LOCAL) == 0
    assert fleet.tokenizer_for("model-c") is None


def test_without_a_fleet_only_the_local_model_is_known(monkeypatch):
    monkeypatch.setattr(models, "FLEET", models.Fleet())
    assert models.FLEET.served() == {}
    assert choose() == ("", None)
    assert choose(adapter="an-adapter") == ("", "an-adapter")  # the tokenizer checks adapter names, as before


def test_another_models_replica_is_foreign(fleet):
    """Its adapter sets are not agreed with the local model's (ingress drops them)."""
    assert fleet.foreign(1) and not fleet.foreign(0) and not fleet.foreign(7)
