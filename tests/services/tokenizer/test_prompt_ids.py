"""A prompt given as token ids (OpenAI completions): taken as it is, checked against the vocabulary, and held to
the same length rules as a text prompt."""

from __future__ import annotations

import msgspec
import pytest
from tokenizers import Tokenizer

from libs.protocol import codec
from libs.protocol.messages import RequestError, TokenizedRequest

from .conftest import request


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def with_ids(ids, **params):
    return msgspec.structs.replace(request("", **params), prompt_ids=ids)


def test_ids_equal_text(processor, tokenizer):
    ids = tokenizer.encode("the cat sat").ids
    text = processor.process(request("the cat sat", max_new_tokens=2, decoder_input_details=True))
    out = codec.decode(codec.encode(processor.process(with_ids(ids, max_new_tokens=2, decoder_input_details=True))))
    assert isinstance(out, TokenizedRequest)
    assert out.input_ids.tolist() == text.input_ids.tolist() == ids
    assert (out.max_new_tokens, out.sampling) == (text.max_new_tokens, text.sampling)
    # ids are used as they are: no <bos> added, no re-tokenizing of an unusual split
    split = [tokenizer.token_to_id("t"), tokenizer.token_to_id("h")]
    assert processor.process(with_ids(split, max_new_tokens=1)).input_ids.tolist() == split


def test_bad_ids(processor, tokenizer):
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    for ids in ([5, vocab], [-1], []):
        out = processor.process(with_ids(ids, max_new_tokens=1))
        assert isinstance(out, RequestError) and out.error_type == "validation", ids
    out = processor.process(with_ids([5, vocab + 3], max_new_tokens=1))
    assert out.message == (
        f"Input validation error: token id {vocab + 3} in `prompt` is out of the vocabulary "
        f"(ids must be >= 0 and < {vocab})"
    )
    assert processor.process(with_ids([], max_new_tokens=1)).message.endswith("`inputs` cannot be empty")


def test_id_prompt_over_the_input_limit(processor):
    out = processor.process(with_ids([5] * 21, max_new_tokens=1, decoder_input_details=True))
    assert isinstance(out, RequestError)
    assert out.message == "Input validation error: `inputs` must have less than 20 tokens. Given: 21"
    out = processor.process(with_ids([5] * 20, max_new_tokens=1, top_n_tokens=6))
    assert out.message == "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 6"
