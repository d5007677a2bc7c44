"""IncrementalDecoder against a real byte-level BPE tokenizer trained here on a small fixed corpus."""

import functools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.detokenizer.incremental import MAX_PENDING, IncrementalDecoder, special_ids

CORPUS = [
    "Hello world. The end of the story is near.",
    "café crème brûlée à la carte, naïve façade",
    "中文字符和日本語のテキスト",
    "emoji: 🙂 🚀 👍🏽 and more text",
] * 20
FFFD = "\ufffd"


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is a token, so any text encodes; deterministic for a fixed corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@functools.lru_cache(maxsize=1)
def _byte_chars() -> dict[int, str]:
    # GPT-2's bytes_to_unicode: the printable character that stands for each byte in a byte-level vocab
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_token(b: int) -> int:
    """The id of the single-byte token for byte b."""
    return build_tokenizer().token_to_id(_byte_chars()[b])


def run(dec: IncrementalDecoder, ids: list[int]) -> list[str]:
    out = [dec.push(i) for i in ids]
    assert not any(FFFD in piece for piece in out)
    return out


TEXTS = [
    "Hello world. The end.",
    "café crème — naïve façade",
    "中文字符 and 日本語",
    "emoji 🙂🚀👍🏽 mixed with ASCII, ü and 한국어 (unseen)",
    "🦀🦀🦀",  # unseen emoji: split into single-byte tokens
]


@pytest.mark.parametrize("text", TEXTS)
def test_concatenation_equals_full_decode(text):
    tok = build_tokenizer()
    ids = tok.encode(text).ids
    out = run(IncrementalDecoder(tok, []), ids)
    assert "".join(out) == tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_tail(text):
    tok = build_tokenizer()
    prompt = tok.encode("Some prompt with 中文 and é: ").ids
    ids = tok.encode(text).ids
    dec = IncrementalDecoder(tok, prompt)
    assert "".join(run(dec, ids)) == tok.decode(ids)
    assert dec.final_text() == text
    assert dec.generated == ids


def test_split_character_is_held_back():
    tok = build_tokenizer()
    dec = IncrementalDecoder(tok, tok.encode("x").ids)
    ids = [byte_token(b) for b in "é🙂".encode()]  # C3 A9 F0 9F 99 82
    assert run(dec, ids) == ["", "é", "", "", "", "🙂"]


def test_invalid_bytes_keep_window_bounded():
    tok = build_tokenizer()
    dec = IncrementalDecoder(tok, tok.encode("prompt").ids)
    windows = []
    out = []
    for _ in range(500):  # lone continuation bytes: never valid UTF-8
        out.append(dec.push(byte_token(0x80)))
        windows.append(dec.window)
    assert not any(FFFD in piece for piece in out)
    assert max(windows) <= 2 * (MAX_PENDING + 1) + 1
    # text after the garbage still comes out
    assert "".join(run(dec, tok.encode(" after 中").ids)) == " after 中"


def test_character_completed_after_giving_up():
    # the give-up happens with a lead byte pending; its continuation bytes come next and must still decode
    tok = build_tokenizer()
    dec = IncrementalDecoder(tok, [])
    ids = tok.encode("a").ids + [byte_token(0x80)] * MAX_PENDING + [byte_token(b) for b in "中".encode()]
    ids += tok.encode("b").ids
    assert "".join(run(dec, ids)) == "a中b"


def test_incomplete_end_flush_and_final_text():
    tok = build_tokenizer()
    dec = IncrementalDecoder(tok, tok.encode("p").ids)
    ids = tok.encode("ok").ids + [byte_token(0xE4), byte_token(0xB8)]
    assert "".join(run(dec, ids)) == "ok"
    assert dec.flush() == ""  # the incomplete character is dropped, not emitted as U+FFFD
    assert dec.flush() == ""
    assert dec.final_text() == "ok"


def test_special_tokens():
    tok = build_tokenizer()
    eos, bos = tok.token_to_id("<eos>"), tok.token_to_id("<bos>")
    assert special_ids(tok) == {tok.token_to_id("<pad>"), bos, eos}
    assert special_ids(tok) is special_ids(tok)  # cached per tokenizer
    dec = IncrementalDecoder(tok, [bos] + tok.encode("Hi").ids)
    ids = tok.encode("Hello world").ids + [eos]
    out = run(dec, ids)
    assert out[-1] == "<eos>"
    assert "".join(out) == "Hello world<eos>"
    assert dec.final_text() == "Hello world"
    assert dec.special(eos) and not dec.special(ids[0])


def test_final_text_keeps_unicode():
    tok = build_tokenizer()
    text = "café 中文 🙂 end"
    dec = IncrementalDecoder(tok, tok.encode("Q: ").ids)
    run(dec, tok.encode(text).ids)
    assert dec.final_text() == text
