"""The speculative bench's steady rate (bench/workloads/speculative.py): tokens counted only while every client of a
closed-loop turn was busy, so a turn's tail (rows that finished early leave the batch smaller) is not in the ratio."""

from bench.serving.loadgen import Sample
from bench.workloads.speculative import steady


def test_the_steady_rate_counts_tokens_until_the_last_request_was_sent():
    first = Sample(sent=0.0, events=[1.0, 2.0, 3.0, 4.0], tokens=4)
    second = Sample(sent=2.0, events=[2.5, 5.0, 9.0], tokens=6)  # the last one sent: every client busy until t=2
    tokens, seconds = steady([first, second], started=0.0)
    assert seconds == 2.0
    assert tokens == 2 + 0  # first's events at 1 and 2; second's first event (at 2.5) came after
    late = Sample(sent=3.0, events=[3.5], tokens=1)
    tokens, seconds = steady([first, second, late], started=0.0)
    assert seconds == 3.0 and tokens == 3 + 2  # events of 2 tokens each for `second` (6 tokens in 3 events)


def test_the_json_workload_sends_its_grammar_and_the_others_none():
    from bench.serving.loadgen import Job
    from bench.workloads.speculative import EXTRACT, GRAMMARS, dialect
    from services.tokenizer.grammar import grammar_text

    job = Job("Write this list as JSON", 5, 32)
    path, body = dialect("json").request(job)
    assert path == "/generate_stream" and body["parameters"]["grammar"] == {"type": "json", "value": EXTRACT}
    assert all("grammar" not in dialect(w).request(job)[1]["parameters"] for w in ("copy", "free"))
    assert grammar_text(GRAMMARS["json"])[1]  # the tokenizer accepts it (it raises on a bad grammar)
