"""Phase 3, speed: a Llama-3-8B-shaped bf16 model built in memory, 1 to 256 streams, per attention backend,
against the roof and transformers' own generation."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import time

import numpy as np
import torch

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner

from .common import backend_kwargs, runner_takes, sync, triton_module
from .probe import phase0
from .report import Report


def llama8b_config(quick: bool):
    from transformers import LlamaConfig

    if quick:
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            eos_token_id=2,
        )
    return LlamaConfig(  # Llama-3-8B's shapes
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        eos_token_id=128001,
        bos_token_id=128000,
    )


def speed_variants(dev: torch.device) -> list[tuple[str, dict, str]]:
    """(name, ModelRunner kwargs, why skipped or '') for each way of running the runner."""
    mod, why = triton_module()
    takes = runner_takes("attention")
    out = [("torch", backend_kwargs("torch"), "")]
    out.append(("triton", {"attention": "triton"}, "" if mod and takes else why or "ModelRunner takes no `attention`"))
    graphs = importlib.util.find_spec("services.shard.graphs") is not None
    graph_why = ""
    if dev.type != "cuda":
        graph_why = "CUDA graphs need CUDA"
    elif not graphs or not runner_takes("cuda_graphs"):
        graph_why = "services/shard/graphs.py or ModelRunner(cuda_graphs=) not present"
    out.append(("triton+graphs", {"attention": "triton", "cuda_graphs": True}, graph_why or ("" if mod else why)))
    return out


def run_streams(runner: ModelRunner, streams: int, prompt_len: int, decode: int, vocab: int) -> dict:
    """`streams` requests of `prompt_len` random tokens, `decode` new tokens each, all joined at once: prefill
    seconds, and the decode steps' median milliseconds and tokens per second."""
    rng = np.random.default_rng(streams)
    engine = Engine.build(runner, None, eos_ids=set(), max_batch_size=max(streams, 1), max_batch_prefill_tokens=8192)
    for i in range(streams):
        engine.add(request(str(i), rng.integers(3, vocab, prompt_len).tolist(), decode))
    prefill_s, decode_steps = 0.0, []
    while engine.batcher.has_work():
        t = time.perf_counter()
        rows = engine.step()
        dt = time.perf_counter() - t  # the step's tokens came back to the host: the device is done
        if rows is None:
            break
        if rows and all(r.offset > 0 for r in rows):
            decode_steps.append(dt)
        else:
            prefill_s += dt
    step_ms = 1e3 * float(np.median(decode_steps)) if decode_steps else float("nan")
    return dict(prefill_s=prefill_s, decode_step_ms=step_ms, decode_tok_s=streams / step_ms * 1e3)


def phase3(rep: Report, dev: torch.device, quick: bool, budget_s: float) -> None:
    if dev.type != "cuda" and not quick:
        rep.skip(3, "speed", "the 8B-shaped model needs CUDA (--quick runs tiny shapes on a CPU)")
        return
    start = time.monotonic()
    config = llama8b_config(quick)
    streams_list = (1, 4) if quick else (1, 16, 64, 256)
    prompt_len, decode, bs = (16, 8, 16) if quick else (128, 64, 16)
    blocks = max(streams_list) * math.ceil((prompt_len + decode) / bs) + 16
    bandwidth = rep.value(0, "copy bandwidth", "gb_per_s")
    if bandwidth is None:
        phase0(rep, dev, quick)
        bandwidth = rep.value(0, "copy bandwidth", "gb_per_s")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, bf16
    weights = None
    for name, kwargs, why in speed_variants(dev):
        if why:
            rep.skip(3, f"speed {name}", why)
            continue
        try:
            runner = ModelRunner.from_config(
                config, num_blocks=blocks, block_size=bs, dtype=torch.bfloat16, device=dev, seed=0, **kwargs
            )
        except Exception as e:
            rep.add(3, f"speed {name}", "fail", f"{type(e).__name__}: {e}")
            continue
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        run_streams(runner, 1, prompt_len, 4, config.vocab_size)  # warm-up (kernels, allocator)
        for streams in streams_list:
            if time.monotonic() - start > budget_s:
                rep.skip(3, f"speed {name} ×{streams}", f"phase 3's {budget_s:.0f} s budget spent")
                continue
            try:
                got = run_streams(runner, streams, prompt_len, decode, config.vocab_size)
            except Exception as e:
                rep.add(3, f"speed {name} ×{streams}", "fail", f"{type(e).__name__}: {e}")
                continue
            kv = streams * (prompt_len + decode / 2) * kv_per_token
            roof_ms = 1e3 * (weights + kv) / (bandwidth * 1e9)
            got["roof_step_ms"] = roof_ms
            detail = (
                f"decode step {got['decode_step_ms']:.2f} ms (roof {roof_ms:.2f}), "
                f"{got['decode_tok_s']:.0f} tok/s, prefill {got['prefill_s']:.2f} s"
            )
            rep.add(3, f"speed {name} ×{streams}", "ok", detail, streams=streams, **got)
        del runner
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    transformers_speed(rep, dev, quick, config, streams_list, prompt_len, decode, start, budget_s)


def transformers_speed(rep, dev, quick, config, streams_list, prompt_len, decode, start, budget_s) -> None:
    """transformers' own generate() (static batch, sdpa) and generate_batch (continuous batching) on the same
    model, where this transformers has them."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    for streams in streams_list:
        if time.monotonic() - start > budget_s:
            rep.skip(3, f"transformers generate ×{streams}", f"phase 3's {budget_s:.0f} s budget spent")
            continue
        rng = np.random.default_rng(streams)
        ids = torch.from_numpy(rng.integers(3, config.vocab_size, (streams, prompt_len))).to(dev)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
        try:
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
                sync(dev)
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                sync(dev)
                prefill = time.perf_counter() - t
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=decode, min_new_tokens=decode, **kw)
                sync(dev)
                total = time.perf_counter() - t
            step_ms = 1e3 * (total - prefill) / max(decode - 1, 1)
            detail = f"decode step {step_ms:.2f} ms, {streams / step_ms * 1e3:.0f} tok/s, prefill {prefill:.2f} s"
            rep.add(3, f"transformers generate ×{streams}", "ok", detail, decode_step_ms=step_ms, prefill_s=prefill)
        except Exception as e:
            rep.add(3, f"transformers generate ×{streams}", "fail", f"{type(e).__name__}: {e}")
    if not hasattr(model, "generate_batch"):
        rep.skip(3, "transformers generate_batch", "this transformers has no generate_batch")
        return
    if dev.type != "cuda":  # it sizes its cache to the machine's memory: tens of seconds on a CPU
        rep.skip(3, "transformers generate_batch", "run on CUDA only")
        return
    for streams in streams_list[-2:]:  # where continuous batching matters
        if time.monotonic() - start > budget_s:
            rep.skip(3, f"transformers generate_batch ×{streams}", f"phase 3's {budget_s:.0f} s budget spent")
            continue
        rng = np.random.default_rng(streams)
        inputs = rng.integers(3, config.vocab_size, (streams, prompt_len)).tolist()
        gc = GenerationConfig(max_new_tokens=decode, min_new_tokens=decode, do_sample=False, eos_token_id=None)
        try:
            sync(dev)
            t = time.perf_counter()
            model.generate_batch(inputs=inputs, generation_config=gc)
            sync(dev)
            total = time.perf_counter() - t
            tok_s = streams * decode / total
            detail = f"{tok_s:.0f} tok/s overall ({total:.2f} s for prefill + {decode} tokens each)"
            rep.add(3, f"transformers generate_batch ×{streams}", "ok", detail, total_s=total, tok_s=tok_s)
        except Exception as e:
            rep.add(3, f"transformers generate_batch ×{streams}", "fail", f"{type(e).__name__}: {e}")
    del model
