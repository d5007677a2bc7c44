"""The Processor end to end on the tiny tokenizer: what a request becomes (TokenizedRequest, TokenizeResult or
RequestError), chat requests, tokenize mode and its offsets, and the resolved sampling parameters."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from libs.protocol import codec
from libs.protocol.messages import RequestError, TokenizedRequest, TokenizeResult
from libs.protocol.params import SamplingParams
from services.tokenizer.processor import Processor

from .conftest import request

CHAT = [{"role": "user", "content": "Hi"}]
RENDERED = "<bos><|im_start|>user\nHi<eos>\n<|im_start|>assistant\n"  # the tiny model's chat_template.jinja


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def roomy(settings):
    return Processor.from_settings(settings.replace(max_input_tokens=200, max_total_tokens=300))  # room for a chat


def roundtrip(msg):
    return codec.decode(codec.encode(msg))  # what actually crosses the bus


def test_generate(processor, tokenizer):
    out = processor.process(request("the cat sat", max_new_tokens=3, stop=["."]))
    assert isinstance(out, TokenizedRequest)
    out = roundtrip(out)
    assert out.input_ids.tolist() == tokenizer.encode("the cat sat").ids
    assert out.input_ids[0] == 1  # <bos>: add_special_tokens for a plain request
    assert (out.request_id, out.ingress, out.max_new_tokens, out.stop) == ("r" * 32, 3, 3, ["."])
    assert out.traceparent.startswith("00-0123")
    assert out.sampling == SamplingParams() and out.seed is None


def test_truncate_keeps_the_last_tokens(processor, tokenizer):
    text = "the cat sat " * 6
    out = processor.process(request(text, truncate=4, max_new_tokens=1))
    assert out.input_ids.tolist() == tokenizer.encode(text).ids[-4:]


def test_sampling_resolution(processor):
    out = processor.process(
        request(
            temperature=0.5,
            top_k=3,
            top_p=0.9,
            typical_p=0.8,
            repetition_penalty=1.3,
            frequency_penalty=-0.5,
            watermark=True,
            top_n_tokens=2,
            decoder_input_details=True,
            seed=11,
        )
    )
    assert out.sampling == SamplingParams(
        do_sample=True,
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        typical_p=0.8,
        seed=11,
        repetition_penalty=1.3,
        frequency_penalty=-0.5,
        watermark=True,
        top_n_tokens=2,
        prompt_logprobs=True,
    )
    assert out.seed == 11


def test_greedy_keeps_processors_and_reports(processor):
    out = processor.process(request(repetition_penalty=1.5, watermark=True, top_n_tokens=3, decoder_input_details=True))
    assert not out.sampling.do_sample and out.seed is None
    assert (out.sampling.repetition_penalty, out.sampling.watermark, out.sampling.top_n_tokens) == (1.5, True, 3)
    assert out.sampling.prompt_logprobs


def test_typical_p_alone_samples(processor):
    # the shard samples when a warper changes something (TGI's HeterogeneousNextTokenChooser); typical_p is one
    out = processor.process(request(typical_p=0.5))
    assert out.sampling.do_sample and out.seed is not None


def test_best_of_copies_get_their_own_seeds(processor):
    seeds = {processor.process(request(best_of=2, do_sample=True)).seed for _ in range(4)}
    assert len(seeds) == 4


def test_chat(roomy, tokenizer):
    out = roomy.process(request("", messages=CHAT, max_new_tokens=2))
    assert isinstance(out, TokenizedRequest)
    # rendered, then tokenized without adding specials: the template's own <bos> is the only one
    assert out.input_ids.tolist() == tokenizer.encode(RENDERED, add_special_tokens=False).ids
    assert out.input_ids.tolist().count(1) == 1


def test_chat_validates_the_rendered_prompt(roomy):
    long_chat = [{"role": "user", "content": "the cat sat " * 60}]
    out = roomy.process(request("", messages=long_chat))
    assert isinstance(out, RequestError) and out.error_type == "validation"
    assert out.message.startswith("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 300.")
    # an empty message list renders the generation prompt, which is not empty
    assert isinstance(roomy.process(request("", messages=[], max_new_tokens=1)), TokenizedRequest)


def test_template_error_wins_over_validation(processor, settings, tmp_path, tiny_dir):
    # TGI renders the chat template before it validates the request
    broken = Processor.from_settings(settings.replace(chat_template="{{ raise_exception('no') }}"))
    out = broken.process(request("", messages=CHAT, temperature=0.0))
    assert isinstance(out, RequestError)
    assert (out.error_type, out.message) == ("template_error", "Template error: syntax error: no (in <string>:1)")


def test_no_template(settings, tmp_path, tiny_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    bare = Processor.from_settings(settings.replace(model_path=str(tmp_path)))
    for mode in ("generate", "tokenize"):
        out = bare.process(request("", messages=CHAT, mode=mode))
        assert isinstance(out, RequestError)
        assert (out.message, out.error_type) == ("Template error: template not found", "template_error")
    assert isinstance(bare.process(request("plain prompts need no template")), TokenizedRequest)


def test_override_setting(settings):
    custom = Processor.from_settings(settings.replace(chat_template="{{ messages[0].content }}!"))
    out = custom.process(request("", messages=CHAT, mode="tokenize"))
    assert out.text == "Hi!"


def check_offsets(result: TokenizeResult, tokenizer, text, add_special_tokens=True):
    encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert result.text == text
    assert result.ids.tolist() == encoding.ids
    assert list(zip(result.starts.tolist(), result.stops.tolist())) == [tuple(o) for o in encoding.offsets]


def test_tokenize(processor, tokenizer):
    text = "hello world, the cat sat"
    out = roundtrip(processor.process(request(text, mode="tokenize")))
    assert isinstance(out, TokenizeResult)
    check_offsets(out, tokenizer, text)
    assert (out.starts[0], out.stops[0]) == (0, 0)  # <bos> covers no text
    # the offsets index the text: the pieces of the real tokens put the input back together
    assert "".join(text[a:b] for a, b in zip(out.starts[1:], out.stops[1:])) == text
    assert out.ids.dtype == np.int32 and out.starts.dtype == np.uint32


def test_tokenize_offsets_are_characters(processor, tokenizer):
    text = "héllo wörld ☃"
    out = processor.process(request(text, mode="tokenize"))
    check_offsets(out, tokenizer, text)
    assert max(out.stops) == len(text)  # characters, not bytes (len(text.encode()) is larger)


def test_tokenize_does_not_validate_or_truncate(processor, tokenizer):
    # TGI's /tokenize takes no permit and runs no parameter check; truncate is passed but not applied
    text = "the cat sat " * 6
    out = processor.process(request(text, mode="tokenize", temperature=0.0, truncate=2, best_of=9, stream=True))
    assert isinstance(out, TokenizeResult)
    check_offsets(out, tokenizer, text)
    empty = processor.process(request("", mode="tokenize"))
    assert empty.ids.tolist() == [1]  # just <bos>


def test_chat_tokenize(processor, tokenizer):
    out = processor.process(request("", messages=CHAT, mode="tokenize"))
    assert isinstance(out, TokenizeResult)
    check_offsets(out, tokenizer, RENDERED, add_special_tokens=False)  # /chat_tokenize's templated_text
