"""The compiled walk (services/shard/model/compiled.py) against the eager walk in bf16, through the runner and the
in-process engine: one graph per kind of layer (not per layer); the same logits teacher-forced (each step runs both,
the eager one's K/V kept), greedy tokens free-running; structured output and verified drafts ride in the compiled
step, LoRA rows route it to eager, float32 stays eager; a second start (a new process) loads its kernels from
inductor's cache.

Inductor compiles a tiny model in seconds to a minute (a g++ run per kernel; the machine's load decides): the
llama runs in every `make test`; the other tiny architectures only with SWITCHYARD_TEST_COMPILE_ARCHS=1 (same
checks; 11-15 s each on a quiet machine, a minute on a busy one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.engine import Engine, request
from services.shard.model import onednn
from services.shard.model.compiled import use_cache_dir
from services.shard.model_runner import ModelRunner
from services.tokenizer.grammar import grammar_text
from tests.tiny_models import ARCHS, prompts_for

ALL_ARCHS = os.environ.get("SWITCHYARD_TEST_COMPILE_ARCHS") == "1"
# the compiled walk calls prepacked oneDNN products, which need a CPU that oneDNN runs bf16 on (AVX512-BF16 or AMX;
# on AVX2 alone bf16 keeps torch's linears, and float32 is the default there)
needs_bf16_onednn = pytest.mark.skipif(
    not onednn.dtype_supported(torch.bfloat16), reason="oneDNN runs no bf16 products on this CPU (AVX2 only)"
)
MAX_NEW = 12


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("inductor")
    use_cache_dir(path)
    return path


@pytest.fixture(scope="module")
def llama(tiny_dirs, adapters, cache) -> ModelRunner:
    """The tiny llama's compiled runner, one per module (each compile costs seconds), with a LoRA adapter loaded."""
    return _runner(tiny_dirs["llama"], True, lora_adapters=LORA(adapters))


def LORA(adapters) -> dict[str, str]:
    return {"all": str(adapters[("llama", "all")])}


def _runner(model_dir, compile: bool, **kw) -> ModelRunner:
    return ModelRunner(str(model_dir), num_blocks=96, block_size=16, dtype=torch.bfloat16, compile=compile, **kw)


def _arrivals(model_dir) -> dict[int, list]:
    prompts = prompts_for(model_dir)
    return {0: [request(str(i), prompts[i], MAX_NEW) for i in range(3)], 1: [request("3", prompts[3], MAX_NEW)]}


def _engine(runner: ModelRunner, model_dir) -> Engine:
    return Engine.build(runner, model_dir, max_batch_prefill_tokens=40, max_prefill_tokens_while_decoding=9)


@needs_bf16_onednn
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_bf16_equals_eager_bf16(tiny_dirs, cache, request, arch):
    if arch != "llama" and not ALL_ARCHS:
        pytest.skip("a compile each (11-15 s quiet): SWITCHYARD_TEST_COMPILE_ARCHS=1 runs every tiny architecture")
    model_dir = tiny_dirs[arch]
    runner = request.getfixturevalue("llama") if arch == "llama" else _runner(model_dir, True)
    assert runner.compiled is not None and runner.compiled_reason == ""
    # regional: dynamo traced one layer per kind (Gemma's sliding and global layers: two), every layer reuses it
    kinds = {"gemma2": 2, "gemma3": 2}.get(arch, 1)
    layers = len(runner.compiled.layers)
    assert runner.compiled.kinds == kinds < layers and runner.compiled.graphs == kinds, (runner.compiled.graphs, layers)
    # teacher-forced: every step through both bodies; the eager one's logits (and K/V, written last) go on
    compiled, eager, seen = runner.compiled, runner.forward_packed, []

    def both(batch):
        got = compiled.forward(batch.input_ids, batch.position_ids, batch.keep, batch.paged).float().clone()
        want = eager(batch.input_ids, batch.position_ids, batch.keep, batch.paged)
        seen.append((got, want.float()))
        return want

    runner._forward = both
    before = compiled.counts["compiled"]
    try:
        _engine(runner, model_dir).run(_arrivals(model_dir))
    finally:
        del runner._forward
    assert (
        compiled.counts["compiled"] - before == len(seen) > MAX_NEW
    )  # every step ran the compiled body (prefills too)
    for got, want in seen:
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02)
    agree = sum((g.argmax(-1) == w.argmax(-1)).sum().item() for g, w in seen)
    assert agree >= 0.95 * sum(len(w) for _, w in seen)

    # free-running greedy against an eager runner
    before = dict(compiled.counts)
    got = {k: v.tokens for k, v in _engine(runner, model_dir).run(_arrivals(model_dir)).items()}
    want = {k: v.tokens for k, v in _engine(_runner(model_dir, False), model_dir).run(_arrivals(model_dir)).items()}
    same = sum(a == b for k in want for a, b in zip(got[k], want[k]))
    assert same >= 0.95 * sum(len(v) for v in want.values())
    assert {k: v - before.get(k, 0) for k, v in compiled.counts.items() if v != before.get(k, 0)}.keys() == {"compiled"}


def test_float32_and_unpacked_linears_stay_eager(tiny_dirs):
    runner = ModelRunner(str(tiny_dirs["llama"]), num_blocks=32, dtype=torch.float32, compile=True)
    assert runner.compiled is None and "float32" in runner.compiled_reason
    off = _runner(tiny_dirs["llama"], False)
    assert off.compiled is None and "--no-compile" in off.compiled_reason
    # linears that are not prepacked oneDNN products (torch's own here; quantized ones alike) keep the eager walk
    plain = _runner(tiny_dirs["llama"], True, onednn_linear=False)
    assert plain.compiled is None and "oneDNN" in plain.compiled_reason and plain.walk is not None


@needs_bf16_onednn
def test_grammar_drafts_and_lora_rows(tiny_dirs, adapters, llama):
    """Grammar masks apply to the compiled step's logits; verified drafts are packed tokens like any other (the
    token count is dynamic); a step with LoRA rows runs eagerly (the compiled body calls the base products only)."""
    from libs.protocol.params import SamplingParams
    from tests.services.shard.test_verify import drafted_run

    model_dir = tiny_dirs["llama"]
    runner, eager = llama, _runner(model_dir, False, lora_adapters=LORA(adapters))
    regex = grammar_text({"type": "regex", "value": r"[a-z]{3,9}( [a-z]{2,9}){2,4}\."})[1]
    prompts = prompts_for(model_dir)

    def run(r):
        arrivals = {0: [request("g", prompts[0], 24, grammar=regex), request("lora", prompts[1], 6, adapter="all")]}
        return {k: v.tokens for k, v in _engine(r, model_dir).run(arrivals).items()}

    got, want = run(runner), run(eager)
    assert got["g"] == want["g"] and got["lora"] == want["lora"]
    counts = runner.compiled.counts
    assert counts["compiled"] > 0 and counts["eager: LoRA rows"] > 0  # steps after the LoRA request ended: compiled

    before = counts["compiled"]
    greedy = [SamplingParams() for _ in prompts[1:4]]
    answers, _, _, _ = drafted_run(eager, prompts[1:4], MAX_NEW, greedy)
    drafted, _, _, (n_drafts, accepted) = drafted_run(runner, prompts[1:4], MAX_NEW, greedy, answers)
    assert drafted == answers and 0 < accepted < n_drafts
    assert counts["compiled"] > before


@needs_bf16_onednn
def test_second_start_hits_the_cache(tiny_dirs, cache, llama):
    """A new process building the same model's compiled runner with the same cache folder loads the graph (this
    process's start, `llama`, compiled it into the module's fresh cache folder)."""
    argv = [sys.executable, "-m", "bench.step.compiled", "--start-only", "--model", str(tiny_dirs["llama"]),
            "--cache", str(cache)]  # fmt: skip
    # the same threads: inductor's cache key holds them (a server's restart keeps its thread count)
    env = {**os.environ, "PYTHONPATH": ".", "SWITCHYARD_TORCH_THREADS": str(torch.get_num_threads())}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    start = json.loads(out.stdout.strip().splitlines()[-1])
    assert start["fxgraph_cache_hit"] >= 1 and start["fxgraph_cache_miss"] == 0 and start["graphs"] == 1, start
    print(f"second start: {start['start_s']} s, of which the compile at start {start['compile_s']} s")


@needs_bf16_onednn
def test_a_step_needing_a_new_graph_runs_eagerly(tiny_dirs, llama):
    """A step the graphs compiled at start do not cover runs the eager walk (counted) instead of compiling in the
    step loop: here a layer's norm weights swapped for float32 copies, whose dtype guard no graph passes."""
    from torch._dynamo.utils import counters

    model_dir = tiny_dirs["llama"]
    compiled, layer = llama.compiled, llama.compiled.layers[0]
    norms, graphs = layer.norms, counters["stats"]["unique_graphs"]
    before = compiled.counts["eager: a shape not compiled at start"]
    layer.norms = tuple(w.float() for w in norms)
    try:
        got = {k: v.tokens for k, v in _engine(llama, model_dir).run(_arrivals(model_dir)).items()}
    finally:
        layer.norms = norms
    assert compiled.counts["eager: a shape not compiled at start"] - before > MAX_NEW
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled in the step loop
    want = {k: v.tokens for k, v in _engine(_runner(model_dir, False), model_dir).run(_arrivals(model_dir)).items()}
    assert got == want
