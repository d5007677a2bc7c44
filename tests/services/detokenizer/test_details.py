"""Token texts for `details` (top_tokens, prefill) on the tiny tokenizer, checked against transformers' batch_decode."""

import math

import numpy as np
import pytest
from tokenizers import Tokenizer

from libs.protocol import codec
from libs.protocol.messages import FINISH_ABORTED, FINISH_EOS, FINISH_NONE, StreamOpen, TokenBatch
from services.detokenizer.__main__ import Detokenizer
from tests.tiny_models import BOS, EOS, PAD, build_tokenizer

PROMPT = "Hello world, café 🙂"  # ends in a 4-byte character split over single-byte tokens


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def reference(tok_dir):
    """TGI's way: transformers' batch_decode, one token at a time, no cleanup, special tokens kept."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))

    def texts(ids):
        return hf.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False, skip_special_tokens=False)

    return hf, texts


@pytest.fixture
def detok(tok_dir):
    return Detokenizer(Tokenizer.from_file(str(tok_dir / "tokenizer.json")))


def batch(rows, opens=(), top=None) -> TokenBatch:
    """rows: [(request_id, offset, token, finish)]; top: per row [(id, logprob), …] (None: no frames)."""
    alts = top or []
    msg = TokenBatch(
        replica=0,
        request_ids=[r[0] for r in rows],
        opens=list(opens),
        offsets=np.array([r[1] for r in rows], np.uint32),
        token_ids=np.array([r[2] for r in rows], np.int32),
        logprobs=np.full(len(rows), -0.25, np.float32),
        finish=np.array([r[3] for r in rows], np.uint8),
        top_counts=np.array([len(a) for a in alts], np.int32),
        top_ids=np.array([i for a in alts for i, _ in a], np.int32),
        top_logprobs=np.array([lp for a in alts for _, lp in a], np.float32),
    )
    return codec.decode(codec.encode(msg))


def stream_open(rid, prompt_ids, prompt_logprobs=()) -> StreamOpen:
    return StreamOpen(
        request_id=rid,
        ingress=0,
        replica=0,
        input_length=len(prompt_ids),
        prompt_tail=prompt_ids[-5:],
        prompt_ids=list(prompt_ids) if prompt_logprobs else [],
        prompt_logprobs=list(prompt_logprobs),
    )


def test_prefill_texts_logprobs_and_special_flags(detok, reference):
    hf, texts = reference
    ids = hf(PROMPT)["input_ids"]
    assert ids[0] == BOS
    logprobs = [math.nan] + [-0.5 * k for k in range(1, len(ids))]
    out, _ = detok.handle(batch([("a", 0, EOS, FINISH_EOS)], [stream_open("a", ids, logprobs)]))
    (row,) = out[0]
    prefill = row.final.prefill
    assert [t.id for t in prefill] == ids
    assert [t.text for t in prefill] == texts(ids)
    assert prefill[0].text == "<bos>" and prefill[0].special and prefill[0].logprob is None
    assert not any(t.special for t in prefill[1:])
    assert [t.logprob for t in prefill[1:]] == logprobs[1:]
    assert "\ufffd" in prefill[-1].text  # a lone byte of the emoji: U+FFFD, exactly as TGI shows it


def test_no_prefill_unless_asked(detok, reference):
    hf, _ = reference
    ids = hf(PROMPT)["input_ids"]
    out, _ = detok.handle(batch([("a", 0, EOS, FINISH_EOS)], [stream_open("a", ids)]))
    assert out[0][0].final.prefill == []


def test_top_tokens_follow_their_rows(detok, reference):
    hf, texts = reference
    prompt = hf("The railway")["input_ids"]
    a_alts = [(hf(" yard")["input_ids"][-1], -0.1), (EOS, -2.0), (PAD, -3.0)]
    c_alts = [(BOS, -0.7)]
    opens = [stream_open(r, prompt) for r in "abc"]
    rows = [("a", 0, a_alts[0][0], FINISH_NONE), ("b", 0, 300, FINISH_NONE), ("c", 0, EOS, FINISH_EOS)]
    out, _ = detok.handle(batch(rows, opens, top=[a_alts, [], c_alts]))
    ra, rb, rc = out[0]
    assert [(t.id, t.logprob) for t in ra.top_tokens] == [(i, pytest.approx(lp)) for i, lp in a_alts]
    assert [t.text for t in ra.top_tokens] == texts([i for i, _ in a_alts])
    assert [t.special for t in ra.top_tokens] == [False, True, True]
    assert rb.top_tokens == []
    assert rc.final is not None and [(t.id, t.text, t.special) for t in rc.top_tokens] == [(BOS, "<bos>", True)]


def test_batches_without_alternatives(detok, reference):
    hf, _ = reference
    prompt = hf("The railway")["input_ids"]
    out, _ = detok.handle(batch([("a", 0, 300, FINISH_NONE)], [stream_open("a", prompt)]))
    assert out[0][0].top_tokens == []
    # an abort before any token still ends the stream, with the prefill it asked for
    logprobs = [math.nan] * len(prompt)
    out, _ = detok.handle(batch([("b", 0, -1, FINISH_ABORTED)], [stream_open("b", prompt, logprobs)]))
    (row,) = out[0]
    assert row.final.finish_reason == "aborted" and [t.logprob for t in row.final.prefill] == [None] * len(prompt)
