"""min_tokens holds back stop sequences too (vLLM's rule: a stop string counts only once the output has
min_tokens tokens), while a stop that starts before min_tokens and ends at or after it still matches."""

from libs.protocol.messages import StreamOpen
from services.detokenizer.__main__ import Detokenizer
from tests.services.detokenizer.test_incremental import build_tokenizer
from tests.services.detokenizer.test_resync import batch

F, G, H = 40, 41, 42  # "F", "G", "H" in the byte-level test vocabulary


def opened(rid, stop, min_tokens):
    return StreamOpen(
        request_id=rid, ingress=2, replica=1, input_length=3, prompt_tail=[1, 2, 3], stop=stop, min_tokens=min_tokens
    )


def run(tokens, stop, min_tokens):
    """Feeds the tokens one batch each; returns (generated tokens at the stop, final text) or None if no stop."""
    d = Detokenizer(build_tokenizer())
    for offset, token in enumerate(tokens):
        opens = [opened("r", stop, min_tokens)] if offset == 0 else []
        out, hits = d.handle(batch("r", [offset], [token], opens=opens))
        if hits:
            (hit,) = hits
            return hit.generated_tokens, out[2][-1].final.generated_text
    return None


def test_a_stop_before_min_tokens_is_not_honoured():
    assert run([G, F, F, H], stop=["G"], min_tokens=0) == (1, "G")
    assert run([G, F, F, H], stop=["G"], min_tokens=3) is None  # "G" came at token 1 < 3
    assert run([G, F, G, H], stop=["G"], min_tokens=3) == (3, "GFG")  # token 3 is the first that may stop


def test_a_stop_ending_at_min_tokens_counts_even_when_it_began_before():
    assert run([F, G, H, F], stop=["GH"], min_tokens=3) == (3, "FGH")
    assert run([F, G, H, F], stop=["GH"], min_tokens=4) is None
