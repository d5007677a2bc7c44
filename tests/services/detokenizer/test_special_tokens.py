"""A model whose chat format is written in special tokens (gpt-oss's harmony) keeps them in its text; any other
model's text drops them (TGI's generated_text). A recorded harmony token stream goes through the detokenizer and
the chat answer reader as a request's would: the markers never reach the user, the channels do."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from libs.protocol.messages import FINISH_EOS, StreamOpen
from libs.runtime.settings import Settings
from services.detokenizer.__main__ import Detokenizer
from services.detokenizer.formats import keeps_special_tokens
from services.http.openai.answer import ChatFormat
from tests.harmony_model import build_harmony_tokenizer
from tests.services.detokenizer.test_resync import batch
from tests.tiny_models import build_tokenizer

ANALYSIS = "<|channel|>analysis<|message|>if a < b then<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b>."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    harmony, plain = tmp_path_factory.mktemp("harmony"), tmp_path_factory.mktemp("plain")
    build_harmony_tokenizer(harmony)
    build_tokenizer(plain)
    return harmony, plain


def _detokenized(folder, text: str, end: str) -> tuple[list, str]:
    """`text` then the EOS token `end`, one token a batch → (the rows, the final generated_text)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids + tok.encode(end, add_special_tokens=False).ids
    settings = Settings(model_path=str(folder))
    detok = Detokenizer(tok, keeps_special_tokens(settings))
    rows = []
    for offset, token in enumerate(ids):
        opens = (
            [StreamOpen(request_id="r", ingress=2, replica=1, input_length=3, prompt_tail=[5])] if not offset else []
        )
        finish = [FINISH_EOS] if offset == len(ids) - 1 else None
        out, _ = detok.handle(batch("r", [offset], [token], finish=finish, opens=opens))
        rows += out[2]
    return rows, rows[-1].final.generated_text


def test_the_markers_are_kept_for_a_harmony_model_only(folders):
    harmony, plain = folders
    assert keeps_special_tokens(Settings(model_path=str(harmony)))
    assert not keeps_special_tokens(Settings(model_path=str(plain)))
    # the tiny ChatML template's folder with the harmony parser named by flag keeps them too
    assert keeps_special_tokens(Settings(model_path=str(plain), reasoning_parser="harmony"))
    rows, text = _detokenized(harmony, ANALYSIS + FINAL, "<|return|>")
    assert text == ANALYSIS + FINAL + "<|return|>"
    assert "".join(r.text for r in rows) == text  # the streamed pieces carry them alike (and say they are special)
    assert [r.text for r in rows if r.special][:3] == ["<|channel|>", "<|message|>", "<|end|>"]
    # another model's special tokens are still dropped from its text (the tiny tokenizer's <eos>)
    rows, text = _detokenized(plain, "It is sunny.", "<eos>")
    assert text == "It is sunny." and rows[-1].text == "<eos>" and rows[-1].special


def _read(folder, rows, tools) -> tuple:
    reader = ChatFormat.served(Settings(model_path=str(folder))).reader(tools, None, None, None)
    whole = reader.read(rows[-1].final.generated_text)
    stream, reasoning, content, calls = reader.stream(), "", "", {}
    for row in rows:
        for delta in stream.push(stream.piece(row), row.final is not None):
            if delta[0] == "reasoning":
                reasoning += delta[1]
            elif delta[0] == "content":
                content += delta[1]
            else:
                d = delta[1]
                name, args = calls.get(d.call, (d.name, ""))
                calls[d.call] = (name, args + d.arguments)
    streamed = (reasoning, content, list(calls.values()))
    return (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.calls]), streamed


def test_a_recorded_harmony_stream_reads_as_reasoning_content_and_calls(folders):
    harmony, _ = folders
    rows, _ = _detokenized(harmony, ANALYSIS + FINAL, "<|return|>")
    whole, streamed = _read(harmony, rows, None)
    assert whole == ("if a < b then", "It is <b>sunny</b>.", []) == streamed
    rows, _ = _detokenized(harmony, ANALYSIS + CALL, "<|call|>")
    whole, streamed = _read(harmony, rows, TOOLS)
    assert whole == ("if a < b then", None, [("get_weather", '{"city": "Oslo"}')])
    assert streamed == ("if a < b then", "", [("get_weather", '{"city": "Oslo"}')])
    # the generation prompt ends `<|start|>assistant`: the answer may open with its recipient
    rows, _ = _detokenized(
        harmony, ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}', "<|call|>"
    )
    whole, _ = _read(harmony, rows, TOOLS)
    assert whole == (None, None, [("get_weather", '{"city": "Rome"}')])
