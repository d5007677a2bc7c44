"""launcher.bench.structured's pairing: the unconstrained twins get prompts of their own (the same lengths), so the
prefix cache cannot skip their prefills, and ask for exactly as many tokens as the constrained answers took."""

from launcher.bench import loadgen
from launcher.bench.structured import _folder, _server_side, paired
from launcher.bench.workload import Prompts
from libs.runtime.settings import BLOCK_SIZE


def test_twins_have_fresh_prompts_of_the_same_length():
    _, folder = _folder("tiny")
    prompts = Prompts(folder)
    jobs = prompts.fixed(6, 3 * BLOCK_SIZE + 1, 40)
    answers = [loadgen.Sample(sent=0.0, tokens=n) for n in (12, 40, 1, 0, 25, 7)]
    twins = paired(jobs, answers, Prompts(folder, seed=1))
    assert [t.max_new_tokens for t in twins] == [12, 40, 1, 1, 25, 7]  # an empty answer still asks for one
    assert [t.prompt_tokens for t in twins] == [j.prompt_tokens for j in jobs]
    first_block = {tuple(prompts.tok.encode(j.prompt).ids[:BLOCK_SIZE]) for j in jobs}
    for twin in twins:  # not even the first block of a constrained prompt: no prefix-cache hit at all
        ids = prompts.tok.encode(twin.prompt).ids
        assert len(ids) == twin.prompt_tokens and tuple(ids[:BLOCK_SIZE]) not in first_block


def test_server_side_counts_one_run():
    before = {"tgi_batch_inference_count": 10, "tgi_batch_forward_duration_sum": 1.0}
    after = {
        "tgi_batch_inference_count": 30,
        "tgi_batch_forward_duration_sum": 2.0,
        "tgi_batch_forward_duration_count": 20,
        "switchyard_prefix_cache_hit_tokens_total": 48,
        "switchyard_constrained_rows_sum": 80,
    }
    got = _server_side(before, after, output_tokens=80)
    assert got == {"steps": 20, "tokens_per_step": 4.0, "forward_ms": 50.0, "prefix_hit_tokens": 48,
                   "constrained_rows": 80}  # fmt: skip
