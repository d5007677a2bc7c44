"""The end-to-end vision tests' server: a module's tiny vision model (tests/vision_models.py) served by the six
processes, its request helpers, and the check every family's file makes through it (a markdown image on /generate
gives the processor's prompt tokens and transformers' greedy answer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.e2e.server import Server
from tests.vision_models import data_uri, prompt_ids, reference_generate

MAX_NEW = 8


@dataclass
class VisionServer:
    folder: Path
    server: Server

    @property
    def url(self) -> str:
        return self.server.url

    def generate(self, inputs: str, prefill: bool = True) -> requests.Response:
        """/generate with details; `prefill`: with the prompt's tokens (prompt logprobs: no prefix-cache lookup)."""
        parameters = {"max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": prefill}
        return requests.post(self.url + "/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60)

    def chat(self, parts: list[dict], max_tokens: int) -> requests.Response:
        """/v1/chat/completions with one user message of content `parts`."""
        body = {"model": "tgi", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens}
        return requests.post(self.url + "/v1/chat/completions", json=body, timeout=60)

    def chat_prompt_tokens(self, picture: bytes, max_tokens: int) -> int:
        """The usage's prompt tokens of a chat message of a text part and an OpenAI image_url part (`picture`)."""
        parts = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": data_uri(picture)}}]
        r = self.chat(parts, max_tokens)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]


def serve(build: Callable[[Path], Path], name: str, *flags: str):
    """A module-scoped fixture: the model `build` makes in a temporary folder, served (a KV cache of 4096 tokens,
    then `flags`) until the module's tests are done; it yields a VisionServer."""

    @pytest.fixture(scope="module")
    def vision(tmp_path_factory):
        folder = build(tmp_path_factory.mktemp(name))
        with Server(
            folder, tmp_path_factory.mktemp("logs") / f"{name}-server.log", "--max-batch-total-tokens", "4096", *flags
        ) as server:
            yield VisionServer(folder, server)

    return vision


def markdown_answers(vision: VisionServer, text: str, pictures: list[bytes], placeholder: str = "<image>") -> list:
    """Each picture in turn where `placeholder` stands in `text`, sent as a TGI markdown image on /generate: the
    answer's prompt tokens are the processor's (the image's placeholders count as prompt tokens) and its new tokens
    transformers' greedy ones; the answers differ (the image, not only the text, decides). Returns the (prompt,
    answer) token lists."""
    got = []
    for picture in pictures:
        r = vision.generate(text.replace(placeholder, f"![]({data_uri(picture)})"))
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prompt = prompt_ids(vision.folder, text, [picture])
        assert [t["id"] for t in details["prefill"]] == prompt
        answer = [t["id"] for t in details["tokens"]]
        assert answer == reference_generate(vision.folder, text, [picture], MAX_NEW)
        got.append((prompt, answer))
    assert len({tuple(answer) for _, answer in got}) == len(got)
    return got
