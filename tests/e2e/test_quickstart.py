"""The README's quick start, as a newcomer runs it: the server on the default model (no --model-id) and exactly
the curl requests the README shows, parsed out of README.md, so the test breaks when the README drifts. Every
answer must equal transformers' greedy generate() on the same converted folder (float32, eager attention), the
chat prompt rendered by transformers' apply_chat_template and tokenized with `tokenizers` on tokenizer.json."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest
import requests
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from libs.runtime import model_store
from tests.e2e.conftest import sse_events
from tests.e2e.server import ROOT, SMALL_KV, Server
from tests.reference import reference_generate

pytestmark = pytest.mark.e2e

KNOWN_ANSWER = ("What is the capital of France?", "The capital of France is Paris.")


def quickstart_requests(readme: str) -> list[tuple[str, dict, bool]]:
    """(path, JSON body, streamed) of each curl command in the README's sh blocks above its first `## ` heading."""
    head = readme.split("\n## ", 1)[0]
    found = []
    for block in re.findall(r"```sh\n(.*?)```", head, flags=re.S):
        lines = [line for line in block.splitlines() if not line.lstrip().startswith("#")]
        # one command per chunk starting with `curl` (a quoted body may span lines, as in a shell)
        for command in re.split(r"\n(?=curl )", "\n".join(lines)):
            if not command.startswith("curl "):
                continue
            args = shlex.split(command.replace("\\\n", " "))
            url = next(a for a in args[1:] if a.startswith("localhost:3000/"))
            body = json.loads(args[args.index("-d") + 1])
            found.append((url.removeprefix("localhost:3000"), body, "-N" in args))
    return found


@pytest.fixture(scope="module")
def readme_requests() -> list[tuple[str, dict, bool]]:
    found = quickstart_requests((ROOT / "README.md").read_text(encoding="utf-8"))
    # what the quick start promises: a completion, a chat, and the chat streamed
    assert [(path, stream) for path, _, stream in found] == [
        ("/generate", False),
        ("/v1/chat/completions", False),
        ("/v1/chat/completions", True),
    ]
    assert found[2][1] == {**found[1][1], "stream": True}
    return found


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "quickstart-server.log"
    with Server(None, log, "--dtype", "float32", *SMALL_KV) as server:
        yield server


@pytest.fixture(scope="module")
def folder() -> Path:
    return model_store.resolve_model(None)


def expected(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    ids = reference_generate(folder, prompt_ids, max_new_tokens)
    return ids, Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def post(server: Server, path: str, body: dict, stream: bool) -> requests.Response:
    r = requests.post(server.url + path, json=body, stream=stream, timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_readme_quickstart_equals_transformers(default_server, readme_requests, folder):
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    (gen_path, gen_body, _), (chat_path, chat_body, _), (_, stream_body, _) = readme_requests

    # the first request of a fresh server: its time against a second of the same shape is printed, not asserted
    started = time.perf_counter()
    got = post(default_server, gen_path, gen_body, False).json()
    cold = time.perf_counter() - started
    started = time.perf_counter()
    post(default_server, gen_path, gen_body, False)
    warm = time.perf_counter() - started
    print(f"\nquick start /generate on the default model: first request {cold:.3f} s, second {warm:.3f} s")

    prompt = raw.encode(gen_body["inputs"]).ids
    _, text = expected(folder, prompt, gen_body["parameters"]["max_new_tokens"])
    assert got["generated_text"] == text

    # chat: the prompt as transformers renders it, tokenized with `tokenizers` (the template holds the specials)
    messages = chat_body["messages"]
    rendered = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt = raw.encode(rendered, add_special_tokens=False).ids
    ids, text = expected(folder, prompt, chat_body["max_tokens"])
    assert (messages[-1]["content"], text) == KNOWN_ANSWER  # the README promises this answer
    stopped = len(ids) < chat_body["max_tokens"]

    chat = post(default_server, chat_path, chat_body, False).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert chat["choices"][0]["finish_reason"] == ("stop" if stopped else "length")
    assert chat["usage"]["prompt_tokens"] == len(prompt)
    assert chat["usage"]["completion_tokens"] == len(ids)

    events = sse_events(post(default_server, chat_path, stream_body, True).content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == ("stop" if stopped else "length")
