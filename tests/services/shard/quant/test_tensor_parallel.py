"""A quantized model under tensor parallelism (2 ranks, gloo): each rank keeps its part of every quantized linear, with
its scales and zeros split alongside (output rows for column-parallel layers, whole groups of input columns for
row-parallel ones), and transformers' tensor-parallel forward around it. A GPTQ checkpoint's greedy tokens equal
generate() on its dense twin; W8A8 quantized at load gives the single-process W8A8 runner's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from bench.engine import Engine, request
from tests.ports import free_port
from tests.reference import reference_generate
from tests.services.shard.quant.checkpoints import write
from tests.services.shard.quant.test_layers import WEIGHT_ONLY_TOL
from tests.services.shard.test_model_runner_logprobs import reference_prompt_logprobs
from tests.tiny_models import prompts_for

WORLD = 2
# W8A8 row-parallel layers scale each rank's slice of an activation row on its own (no collective for a shared scale):
# measured ≤ 0.27 in log-prob from the single-process W8A8 runner on these peaked models; a wrong split moves them by
# several units
TP_W8A8_TOL = 0.5
GPTQ_ARCHS = ("llama", "qwen2")


def _arrivals(prompts: list[list[int]]) -> dict[int, list]:
    return {
        0: [request("0", prompts[0], 8, prompt_logprobs=True), request("1", prompts[1], 10)],
        2: [request("2", prompts[2], 8, prompt_logprobs=True)],  # chunks of 8 joining the running decodes
    }


def _run(runner, model_dir: Path, token_dir: Path) -> dict:
    """Greedy tokens and prompt log-probs (of the requests that asked for them) of the schedule, by request."""
    engine = Engine.build(runner, model_dir, max_prefill_tokens_while_decoding=8)
    got = engine.run(_arrivals(prompts_for(token_dir)))
    assert engine.batcher.counters["chunked_prefills"] > 0 and engine.batcher.counters["joined_steps"] > 0
    prompt = {rid: out.prompt_logprobs[1:] for rid, out in got.items() if out.prompt_logprobs}
    return {"tokens": {rid: out.tokens for rid, out in got.items()}, "prompt_logprobs": prompt}


def _rank(rank: int, jobs: dict[str, tuple[str, str, str]], port: int, out: str) -> None:
    """One rank serving every job (model folder, quantize method, tokenizer folder) in turn, in one process group (a
    spawn costs seconds of imports)."""
    import torch.distributed as dist

    from services.shard import tensor_parallel
    from services.shard.model_runner import ModelRunner
    from services.shard.quant import layers as quant_layers

    torch.set_num_threads(1)
    tensor_parallel.STALE_S = 0.0
    tensor_parallel.init_group(rank, WORLD, port, torch.device("cpu"), timeout_s=60)
    try:
        for key, (model_dir, quantize, token_dir) in jobs.items():
            runner = ModelRunner(model_dir, num_blocks=64, block_size=8, quantize=quantize, grammar=False)
            layers = {n: m for n, m in runner.model.named_modules() if isinstance(m, quant_layers.QuantLinear)}
            q = runner.model.get_submodule("model.layers.0.self_attn.q_proj")
            o = runner.model.get_submodule("model.layers.0.self_attn.o_proj")
            got = _run(runner, Path(model_dir), Path(token_dir))
            got.update(kinds=sorted({type(m).__name__ for m in layers.values()}), count=len(layers),
                       q_local=list(q.weight.shape), o_local=list(o.weight.shape))  # fmt: skip
            Path(f"{out}.{key}.{rank}").write_text(json.dumps(got))
        dist.barrier()  # both ranks out of their last collective before either tears its connections down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory) -> tuple[dict[str, Path], dict[str, list[dict]]]:
    """(arch → its GPTQ checkpoint folder, job → each rank's results), from one spawn of two ranks serving a GPTQ
    checkpoint of llama and of qwen2 (its q/k/v carry a bias, split with their rows) and llama quantized W8A8 at
    load."""
    root = tmp_path_factory.mktemp("quant-tp")
    ckpts = {arch: write(tiny_dirs[arch], root / arch, "gptq", bits=4, group=32, sym=False) for arch in GPTQ_ARCHS}
    jobs = {f"gptq-{arch}": (str(c / "quant"), "gptq", str(c / "twin")) for arch, c in ckpts.items()}
    jobs["eetq-llama"] = (str(tiny_dirs["llama"]), "eetq", str(tiny_dirs["llama"]))
    out = str(root / "ranks")
    mp.spawn(_rank, args=(jobs, free_port(), out), nprocs=WORLD, join=True)
    return ckpts, {key: [json.loads(Path(f"{out}.{key}.{r}").read_text()) for r in range(WORLD)] for key in jobs}


def _two_ranks(served, key: str, model_dir: Path) -> list[dict]:
    ranks = served[1][key]
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # every rank samples the same token from the same logits
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    for r in ranks:  # the feature fired: every linear but the LM head quantized, and each rank holds half of it
        assert r["q_local"] == [hidden // WORLD, hidden] and r["o_local"] == [hidden, hidden // WORLD]
    return ranks


@pytest.mark.parametrize("arch", GPTQ_ARCHS)
def test_a_gptq_checkpoint_under_two_ranks_matches_its_twin(served, arch):
    out = served[0][arch]
    ranks = _two_ranks(served, f"gptq-{arch}", out / "quant")
    layers = json.loads((out / "quant" / "config.json").read_text())["num_hidden_layers"]
    assert ranks[0]["count"] == 7 * layers and ranks[0]["kinds"] == ["Int4Linear"]
    for req in (r for reqs in _arrivals(prompts_for(out / "twin")).values() for r in reqs):
        rid, prompt = req.request_id, req.input_ids.tolist()
        assert ranks[0]["tokens"][rid] == reference_generate(out / "twin", prompt, req.max_new_tokens), rid
        if req.sampling.prompt_logprobs:
            want = reference_prompt_logprobs(out / "twin", prompt)[1:]
            np.testing.assert_allclose(ranks[0]["prompt_logprobs"][rid], want, rtol=0, atol=2e-4 + WEIGHT_ONLY_TOL)


def test_w8a8_at_load_under_two_ranks_matches_one_rank(tiny_dirs, served):
    from services.shard.model_runner import ModelRunner

    model_dir = tiny_dirs["llama"]
    ranks = _two_ranks(served, "eetq-llama", model_dir)
    assert ranks[0]["kinds"] == ["W8A8Linear"]
    single = _run(ModelRunner(str(model_dir), num_blocks=64, block_size=8, quantize="eetq"), model_dir, model_dir)
    for rid, want in single["prompt_logprobs"].items():
        got = ranks[0]["prompt_logprobs"][rid]
        np.testing.assert_allclose(got, want, rtol=0, atol=TP_W8A8_TOL)


def test_desc_act_cannot_be_split_by_input_columns(tiny_dirs):
    from services.shard.quant.formats import quantize_rtn, shard_for_rank

    qw = quantize_rtn(torch.randn(8, 64), 4, 32, symmetric=False)
    col = shard_for_rank(qw, "col", 4, 4)
    assert torch.equal(col.levels, qw.levels[4:]) and torch.equal(col.scales, qw.scales[4:])
    row = shard_for_rank(qw, "row", 32, 32)
    assert torch.equal(row.levels, qw.levels[:, 32:]) and torch.equal(row.zeros, qw.zeros[:, 1:])
    qw.g_idx = torch.arange(64) % 2
    with pytest.raises(ValueError, match="desc_act"):
        shard_for_rank(qw, "row", 32, 32)
    with pytest.raises(ValueError, match="cut groups of 32"):
        shard_for_rank(quantize_rtn(torch.randn(8, 64), 4, 32, symmetric=False), "row", 16, 48)


def test_the_launcher_refuses_what_cannot_be_split(tmp_path):
    from launcher.quantize import QuantizeError, check_shards

    def model(**qc):
        config = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4,
                  "quantization_config": {"quant_method": "gptq", **qc}}  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(config))
        return tmp_path

    check_shards("gptq", model(group_size=32), 2)  # 64 / 2 and 192 / 2 inputs: whole groups of 32 on each rank
    check_shards("gptq", model(group_size=-1), 3)  # one group a row: any split
    check_shards("gptq", model(group_size=32, desc_act=True), 1)
    with pytest.raises(QuantizeError, match="attention width 64 split over 2 ranks cuts the checkpoint.s groups of 64"):
        check_shards("gptq", model(group_size=64), 2)
    with pytest.raises(QuantizeError, match="--num-shard 2: this GPTQ checkpoint has desc_act"):
        check_shards("gptq", model(group_size=32, desc_act=True), 2)
