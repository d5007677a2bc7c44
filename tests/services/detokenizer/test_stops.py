"""StopMatcher on token deltas from a real tokenizer, and on plain strings."""

from services.detokenizer.incremental import IncrementalDecoder
from services.detokenizer.stops import StopMatcher

from .test_incremental import build_tokenizer


def deltas(text: str) -> list[str]:
    tok = build_tokenizer()
    dec = IncrementalDecoder(tok, [])
    return [dec.push(i) for i in tok.encode(text).ids]


def first_hit(stops: list[str], pieces: list[str]) -> tuple[int | None, StopMatcher]:
    m = StopMatcher(stops)
    for i, piece in enumerate(pieces):
        if m.push(piece):
            return i, m
    return None, m


def hit_index(pieces: list[str], stop: str) -> int:
    """Index of the token where `stop` is first complete in the concatenated text."""
    end = "".join(pieces).index(stop) + len(stop)
    acc = 0
    for i, piece in enumerate(pieces):
        acc += len(piece)
        if acc >= end:
            return i
    raise AssertionError


def test_stop_across_tokens():
    pieces = deltas("Hello world. The end of the story is near.")
    for stop in ["world. The", "of the story", "d. T"]:
        i, m = first_hit([stop], pieces)
        assert i == hit_index(pieces, stop)
        assert m.matched == stop
    # the stops above do span 2-3 tokens with this tokenizer
    spans = []
    for stop in ["world. The", "d. T"]:
        text = "".join(pieces)
        s = text.index(stop)
        spans.append(hit_index(pieces, stop) - hit_index(pieces, text[s]) + 1)
    assert max(spans) >= 3 and min(spans) >= 2


def test_stop_in_the_middle_of_a_token():
    pieces = deltas("Hello world. The end.")
    assert "Hello" in pieces  # one token holds the whole word
    i, m = first_hit(["ell"], pieces)
    assert pieces[i] == "Hello" and m.matched == "ell"
    # TGI (anchored at the end) would miss these; we match them
    assert StopMatcher(["\n"]).push("\n\n")
    assert StopMatcher(["XYZ"]).push("abcXYZdef")


def test_stop_with_multibyte_held_back():
    pieces = deltas("emoji: 🦀 done")  # the unseen crab is 4 byte tokens: 3 empty deltas, then 🦀
    i, _ = first_hit(["🦀 d"], pieces)
    assert i == hit_index(pieces, "🦀 d")


def test_no_false_match():
    pieces = deltas("Hello world. The end of the story is near.")
    assert first_hit(["world!", "storyteller", "near.!", "中"], pieces)[0] is None
    m = StopMatcher(["abc"])
    assert not any(m.push(c) for c in "ab ab a bc acb")
    assert not StopMatcher([]).push("anything")
    assert not StopMatcher([""]).push("anything")  # empty stops are ignored
    assert not StopMatcher(["x"]).push("")


def test_multiple_stops():
    pieces = deltas("Hello world. The end of the story is near.")
    i, m = first_hit(["story", "The end", "zzz"], pieces)
    assert m.matched == "The end" and i == hit_index(pieces, "The end")
    # both complete in one delta: the one that ends first is reported
    m = StopMatcher(["cd", "ab"])
    assert m.push("xxabyycdzz") and m.matched == "ab"


def test_tail_stays_bounded():
    m = StopMatcher(["needle", "x"])
    for _ in range(2000):
        assert not m.push("hay stack ")
        assert len(m._tail) <= len("needle") - 1
    assert m.push("nee") is False and m.push("dle") is True
