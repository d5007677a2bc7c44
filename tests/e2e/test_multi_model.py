"""Two models behind one router: a second launcher, as on another host, brings a different model's tokenizer,
detokenizer, scheduler and shard (`serve --model-id B --only tokenizer,detokenizer,scheduler,shard --replica-base 1
--worker-base 1`) to a running server of model A. Requests choose B by OpenAI's `model` field or by the
`X-Gateway-Model-Name` header on TGI's routes, and get B's own greedy output; requests that choose nothing get A's,
as with one model. Each model serves a LoRA adapter the other lacks, and both stay usable (equal to peft). Each
model's requests go through its own tokenizer and replica only (their heartbeat counters, read through a tap);
/v1/models lists both with their adapters; an unknown model is a 404 in the route's own error shape."""

from __future__ import annotations

import pytest
import requests
import torch

from libs.protocol.messages import Heartbeat
from libs.runtime import bus
from tests.e2e.conftest import sse_events
from tests.e2e.server import Server
from tests.e2e.test_scale import LIMITS, Tap, prompt
from tests.lora_adapters import base_model, build_adapter, peft
from tests.ports import free_port_range
from tests.reference import reference_generate
from tests.tiny_models import build_model

pytestmark = pytest.mark.e2e

HEADER = "X-Gateway-Model-Name"
NEW = 6


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


def peft_generate(model_dir, adapter_dir, prompt_ids: list[int]) -> list[int]:
    ref = peft.PeftModel.from_pretrained(base_model(model_dir), adapter_dir).eval()
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = ref.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW)
    return out[0, input_ids.shape[1] :].tolist()


def generate(url: str, text: str, headers: dict | None = None) -> list[int]:
    body = {"inputs": text, "parameters": {"max_new_tokens": NEW, "details": True}}
    r = requests.post(url + "/generate", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def complete(url: str, model: str, text: str) -> str:
    body = {"model": model, "prompt": text, "max_tokens": NEW, "temperature": 0}
    r = requests.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_models_behind_one_router_are_each_answered_by_their_own_replicas(
    tiny_model_dir, other_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr(bus, "_curve", None)  # the tap's sockets: plaintext on loopback, as the servers'
    monkeypatch.setattr(bus, "_plaintext_ok", True)
    a, b = str(tiny_model_dir), str(other_model_dir)
    qv = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = {m: build_adapter(m, tmp_path / f"{name}-lora", seed=7, **qv) for m, name in ((a, "a"), (b, "b"))}
    spec = f"tcp://127.0.0.1:{free_port_range(5)}?replicas=127.0.0.1:{free_port_range(6)}"  # room for replica 1
    common = (*LIMITS, "--bus-address", spec, "--bus-insecure")
    # every program, model A: the default model; each model serves an adapter of its own, which the other lacks
    first = Server(a, tmp_path / "a.log", *common, "--lora-adapters", f"a-lora={lora[a]}")
    only = ("--only", "tokenizer,detokenizer,scheduler,shard", "--replica-base", "1", "--worker-base", "1")
    second = Server(b, tmp_path / "b.log", *common, *only, "--lora-adapters", f"b-lora={lora[b]}")
    tap = None
    try:
        first.wait_healthy()
        tap = Tap(spec, prefixes=(b"hb.",))

        def b_ready() -> bool:
            beats = [m for _, m in tap.seen() if isinstance(m, Heartbeat) and m.model == b]
            return any(m.role == "scheduler" and m.index == 1 and m.ready for m in beats) and any(
                m.role == "tokenizer" and m.index == 1 for m in beats
            )

        tap.wait_for(b_ready, timeout=180)
        listed = requests.get(first.url + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(a, None), ("a-lora", a), (b, None), ("b-lora", b)]

        texts = [prompt(700 + i) for i in range(3)]
        ids = [tiny_tokenizer(t).input_ids for t in texts]
        ref_a = [reference_generate(a, x, NEW) for x in ids]
        ref_b = [reference_generate(b, x, NEW) for x in ids]
        assert ref_a != ref_b, "the two models must answer differently for this test to tell them apart"
        # TGI's route: no header is the default model, as with one model; the header picks the other one
        assert [generate(first.url, t) for t in texts] == ref_a
        assert [generate(first.url, t, {HEADER: b}) for t in texts] == ref_b
        assert [generate(first.url, t, {HEADER: a}) for t in texts[:1]] == ref_a[:1]

        # OpenAI's route: the `model` field
        def text_of(ids: list[int]) -> str:  # an answer never holds U+FFFD (README, API): invalid bytes are dropped
            return tiny_tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")

        assert complete(first.url, b, texts[0]) == text_of(ref_b[0])
        assert complete(first.url, "tgi", texts[0]) == text_of(ref_a[0])
        # a streamed chat: B's tokenizer renders the template, B's detokenizer streams the answer
        messages = [{"role": "user", "content": texts[1]}]
        rendered = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat_ids = tiny_tokenizer(rendered, add_special_tokens=False).input_ids  # the template holds the specials
        body = {"model": b, "messages": messages, "max_tokens": NEW, "temperature": 0, "stream": True}
        r = requests.post(first.url + "/v1/chat/completions", json=body, timeout=60)
        deltas = [e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text)[:-1] if e["choices"]]
        assert "".join(deltas) == text_of(reference_generate(b, chat_ids, NEW))

        # an adapter of either model, though the other model's replica lacks it
        body = {"inputs": texts[2], "parameters": {"max_new_tokens": NEW, "details": True, "adapter_id": "a-lora"}}
        r = requests.post(first.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == peft_generate(a, lora[a], ids[2])
        assert complete(first.url, "b-lora", texts[2]) == text_of(peft_generate(b, lora[b], ids[2]))

        # each model's requests went through its own tokenizer and replica only: 3 + 1 + 1 + 1 on each
        def settled():
            placed = tap.counters("router").get(0, {})
            handled = {n: c.get("handled", 0) for n, c in tap.counters("tokenizer").items()}
            want = ({"placed_replica_0": 6, "placed_replica_1": 6}, {0: 6, 1: 6})
            return (placed, handled) if (placed, handled) == want else None

        tap.wait_for(settled)
        assert "taking only requests that name it" in (tmp_path / "b.log").read_text()  # B's tokenizer kept off intake

        unknown = requests.post(first.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        body = {"inputs": "x", "parameters": {"max_new_tokens": 2}}
        unknown = requests.post(first.url + "/generate", json=body, headers={HEADER: "nope"}, timeout=10)
        assert unknown.status_code == 404
        assert unknown.json() == {"error": "The model `nope` does not exist.", "error_type": "model_not_found"}
    finally:
        if tap is not None:
            tap.close()
        second.stop()
        first.stop()
