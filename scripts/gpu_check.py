"""The device check: the one script a GPU session runs (`python scripts/gpu_check.py --out DIR`), in phases.

0 probe: versions, TF32 off, measured copy bandwidth and bf16 matmul rate. 1 kernel: the Triton paged attention
against the torch path on random paged caches (float32, bf16). 2 identity: the tiny architectures through
ModelRunner and the in-process engine (staggered joins, chunked prefill) token-identical to transformers'
generate() in float32, and bf16 teacher-forced within tolerance. 3 speed: a Llama-3-8B-shaped bf16 model built in
memory, 1 to 256 streams, per attention backend, against the roof and transformers' own generation. 4 served: the
six processes over HTTP, tokens equal to the in-process run. Each phase adds its rows to DIR/gpu_check.json and
DIR/gpu_check.md (a re-run phase replaces its own rows). `--quick`: tiny shapes, so it runs on a CPU; what needs
CUDA says so in a skipped row.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import inspect
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.engine import Engine, request  # noqa: E402
from services.shard.attention.paged import PagedBatch, attend_layer  # noqa: E402
from services.shard.model_runner import ModelRunner  # noqa: E402

WHEELS = ROOT / ".gpu-wheels"
SERVED_MODULES = ("zmq", "msgspec", "orjson", "llguidance", "supervisor", "opentelemetry", "interegular", "gguf")
PHASES = (0, 1, 2, 3, 4)


# ------------------------------------------------------------------------------------------------------------------
class Report:
    """The rows of every phase run into --out so far: (phase, check, status, detail, values); written after each
    row, so a run cut short still leaves what it measured."""

    def __init__(self, out: Path, phases: list[int]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = out / "gpu_check.json", out / "gpu_check.md"
        old = json.loads(self.json_path.read_text()) if self.json_path.exists() else {}
        self.rows = [r for r in old.get("rows", []) if r["phase"] not in phases]
        self.meta = old.get("meta", {})

    def add(self, phase: int, check: str, status: str, detail: str = "", **values) -> None:
        row = dict(phase=phase, check=check, status=status, detail=detail, values=values)
        self.rows.append(row)
        print(f"[phase {phase}] {status:4} {check}: {detail}", flush=True)
        self.write()

    def skip(self, phase: int, check: str, why: str) -> None:
        self.add(phase, check, "skip", why)

    def value(self, phase: int, check: str, key: str):
        for r in self.rows:
            if r["phase"] == phase and r["check"] == check and key in r["values"]:
                return r["values"][key]
        return None

    def write(self) -> None:
        self.rows.sort(key=lambda r: r["phase"])
        self.json_path.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1, default=str))
        lines = ["| phase | check | status | detail |", "|---|---|---|---|"]
        for r in self.rows:
            detail = str(r["detail"]).replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['phase']} | {r['check']} | {r['status']} | {detail} |")
        self.md_path.write_text("\n".join(lines) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int = 10, warmup: int = 3, args: tuple = ()) -> float:
    """Mean seconds of one call of `fn(*args)` (after warm-up calls), the device synchronized around the timed
    ones."""
    for _ in range(warmup):
        fn(*args)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    sync(device)
    return (time.perf_counter() - t) / reps


def triton_module():
    """The Triton attention module, or the reason it cannot run here."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return None, "triton is not installed"
    try:
        mod = importlib.import_module("services.shard.attention.triton")
    except ImportError as e:
        return None, f"services/shard/attention/triton.py not importable ({e})"
    if not hasattr(mod, "attend_layer_triton"):
        return None, "services/shard/attention/triton.py has no attend_layer_triton"
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            return None, "needs CUDA, or TRITON_INTERPRET=1 on a CPU"
        from tests.triton_interpreter import install_interpreter_shims  # the interpreter's gaps on a CPU

        install_interpreter_shims()
    return mod, ""


def runner_takes(name: str) -> bool:
    return name in inspect.signature(ModelRunner.__init__).parameters


def attention_backends() -> list[str]:
    """The attention backends ModelRunner can run here: torch always, triton where the module and the parameter
    are there."""
    mod, _ = triton_module()
    return ["torch"] + (["triton"] if mod is not None and runner_takes("attention") else [])


def backend_kwargs(backend: str) -> dict:
    """ModelRunner's keyword for `backend`, named even for torch (the runner's default may pick triton on CUDA)."""
    return {"attention": backend} if runner_takes("attention") else {}


# ------------------------------------------------------------------------------------------------------------------
def phase0(rep: Report, dev: torch.device, quick: bool) -> None:
    import transformers

    mod, why = triton_module()
    try:
        triton_version = importlib.import_module("triton").__version__
    except ImportError:
        triton_version = None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    versions = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton_version,
        transformers=transformers.__version__,
        cuda=torch.version.cuda,
        device=str(dev),
        gpu=gpu,
        tf32=torch.backends.cuda.matmul.allow_tf32,
        triton_attention=mod is not None or why,
    )
    rep.meta.update(versions)
    rep.add(0, "versions", "ok", ", ".join(f"{k} {v}" for k, v in versions.items()), **versions)

    n = (16 << 20) if quick else (2 << 30)  # bytes copied; ×2 moved (read + write)
    src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    sec = timed(src.clone().copy_, dev, reps=5 if quick else 20, args=(src,))
    gbs = 2 * n / sec / 1e9
    rep.add(0, "copy bandwidth", "ok", f"{gbs:.0f} GB/s (read + write, {n >> 20} MiB copy)", gb_per_s=gbs)
    src = None

    size = 256 if quick else 8192
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    sec = timed(lambda: a @ b, dev, reps=3 if quick else 10)
    tflops = 2 * size**3 / sec / 1e12
    rep.add(0, "bf16 matmul", "ok", f"{tflops:.1f} TFLOP/s ({size}³, random)", tflops=tflops)


# ------------------------------------------------------------------------------------------------------------------
def paged_layout(
    context_lens: list[int], num_tokens: list[int], block_size: int, num_blocks: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows' block tables drawn at random from the pool, their new tokens' slots, and cu: the runner's layout."""
    rng = np.random.default_rng(seed)
    need = [math.ceil((c + n) / block_size) for c, n in zip(context_lens, num_tokens)]
    if sum(need) > num_blocks:
        raise ValueError("pool too small for the rows")
    pool = rng.permutation(num_blocks)
    tables = np.full((len(need), max(need)), -1, dtype=np.int64)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = pool[at : at + k]
        at += k
    cu = np.zeros(len(need) + 1, dtype=np.int64)
    np.cumsum(num_tokens, out=cu[1:])
    counts = np.asarray(num_tokens)
    positions = np.arange(cu[-1]) - np.repeat(cu[:-1], counts) + np.repeat(np.asarray(context_lens), counts)
    rows = np.repeat(np.arange(len(need)), counts)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    return tables, slots, cu


def make_paged(kv_cache, tables, slots, cu, context_lens, block_size, dev) -> PagedBatch:
    ctx = np.asarray(context_lens, dtype=np.int64)
    return PagedBatch(
        kv_cache=kv_cache,
        slot_mapping=torch.from_numpy(slots).to(dev),
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(dev),
        context_lens=torch.from_numpy(ctx.astype(np.int32)).to(dev),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
        block_size=block_size,
        host_cu=cu,
        host_context=ctx,
        host_tables=tables,
    )


def phase1(rep: Report, dev: torch.device, quick: bool) -> None:
    mod, why = triton_module()
    if mod is None:
        rep.skip(1, "triton paged attention", why)
        return
    if quick:
        heads, kv_heads, dim, bs = 4, 2, 16, 16
        contexts, fed = [0, 5, 17, 40, 3], [7, 1, 1, 12, 1]
        windows, caps = (0, 8), (None, 5.0)
    else:
        heads, kv_heads, dim, bs = 32, 8, 128, 16
        rng = np.random.default_rng(1)
        contexts = [int(c) for c in rng.integers(1, 2048, 60)] + [0, 300, 1000, 64]  # decodes, then prefills
        fed = [1] * 60 + [256, 128, 200, 64]
        windows, caps = (0, 256), (None, 50.0)
    need = sum(math.ceil((c + n) / bs) for c, n in zip(contexts, fed))
    num_blocks = need + 8
    tables, slots, cu = paged_layout(contexts, fed, bs, num_blocks, seed=0)
    total = int(cu[-1])
    tolerance = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device="cpu").manual_seed(0)
        shape = (kv_heads, num_blocks, bs, dim)
        base = [tuple(torch.randn(shape, generator=gen).to(dev, dtype) for _ in "kv")]
        q = torch.randn(total, heads, dim, generator=gen).to(dev, dtype)
        k = torch.randn(total, kv_heads, dim, generator=gen).to(dev, dtype)
        v = torch.randn(total, kv_heads, dim, generator=gen).to(dev, dtype)
        for window in windows:
            for cap in caps:
                name = f"{str(dtype).split('.')[-1]} window={window} softcap={cap}"
                caches = {b: [tuple(t.clone() for t in base[0])] for b in ("torch", "triton")}
                papers = {b: make_paged(caches[b], tables, slots, cu, contexts, bs, dev) for b in caches}
                scale = dim**-0.5
                try:
                    want = attend_layer(0, q, k, v, papers["torch"], scale, cap, window)
                    got = mod.attend_layer_triton(0, q, k, v, papers["triton"], scale, cap, window)
                    sync(dev)
                except Exception as e:  # the kernel's interface or launch: the row says what broke
                    rep.add(1, name, "fail", f"{type(e).__name__}: {e}")
                    continue
                err = (got.float() - want.float()).abs().max().item()
                cache_same = all(torch.equal(a, b) for a, b in zip(caches["torch"][0], caches["triton"][0]))
                ok = err <= tolerance[dtype] and cache_same
                timing = {}
                if dev.type == "cuda" and window == 0 and cap is None:
                    for b, fn in (("torch", attend_layer), ("triton", mod.attend_layer_triton)):
                        call = (0, q, k, v, papers[b], scale, cap, window)
                        timing[f"{b}_ms"] = 1e3 * timed(fn, dev, args=call)
                detail = f"max |Δ| {err:.2e} (tolerance {tolerance[dtype]:.0e}), cache writes equal: {cache_same}"
                detail += "".join(f", {name} {ms:.3f}" for name, ms in timing.items())
                rep.add(1, name, "ok" if ok else "fail", detail, max_abs_err=err, cache_equal=cache_same, **timing)


# ------------------------------------------------------------------------------------------------------------------
def tiny_dirs(root: Path) -> dict[str, Path]:
    from tests.tiny_models import ARCHS, build_model

    return {arch: build_model(root / arch, arch) for arch in ARCHS}


def reference_tokens(model_dir: Path, prompt: list[int], max_new: int, dev: torch.device) -> list[int]:
    model = reference_model(str(model_dir), dev, torch.float32)
    ids = torch.tensor([prompt], device=dev)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


_REFERENCES: dict = {}


def reference_model(model_dir: str, dev: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    key = (model_dir, str(dev), dtype)
    if key not in _REFERENCES:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
        _REFERENCES[key] = model.to(dev).eval()
    return _REFERENCES[key]


def phase2(rep: Report, dev: torch.device, quick: bool, work: Path) -> None:
    from tests.tiny_models import prompts_for

    dirs = tiny_dirs(work / "tiny")
    max_new = 10 if quick else 24
    backends = attention_backends()
    if "triton" not in backends:
        rep.skip(2, "identity, triton backend", triton_module()[1] or "ModelRunner takes no `attention` parameter")
    for arch, model_dir in dirs.items():
        prompts = prompts_for(model_dir)
        expected = [reference_tokens(model_dir, p, max_new, dev) for p in prompts]
        for backend in backends:
            check = f"{arch} float32 {backend}"
            try:
                runner = ModelRunner(
                    str(model_dir), num_blocks=96, block_size=4, device=dev, grammar=False, **backend_kwargs(backend)
                )
                engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=32)
                reqs = [request(str(i), p, max_new) for i, p in enumerate(prompts)]
                outputs = engine.run({0: reqs[:3], 2: reqs[3:5], 5: reqs[5:]})  # staggered joins, chunked prefills
            except Exception as e:
                rep.add(2, check, "fail", f"{type(e).__name__}: {e}")
                continue
            wrong = [i for i, want in enumerate(expected) if outputs[str(i)].tokens != want]
            detail = f"{len(prompts)} requests × ≤{max_new} tokens, {engine.steps} steps"
            detail += f"; differ: {wrong}" if wrong else "; every token equals generate()"
            rep.add(2, check, "fail" if wrong else "ok", detail, differ=wrong, steps=engine.steps)
        bf16_forced(rep, dev, arch, model_dir, prompts, expected, backends)


def bf16_forced(rep, dev, arch, model_dir, prompts, expected, backends) -> None:
    """bf16, teacher-forced: the runner's prompt logprobs of prompt + the float32 answer, measured against
    transformers' float32 eager forward over the same tokens, and held to how far transformers' own bf16 eager
    forward is from it (a kernel that rounds differently from eager's bf16 is as exact, not equal)."""
    seqs = [p + e for p, e in zip(prompts, expected)]

    def teacher_forced(dtype):
        ref = reference_model(str(model_dir), dev, dtype)
        out = []
        with torch.inference_mode():
            for s in seqs:
                ids = torch.tensor([s], device=dev)
                lp = torch.log_softmax(ref(ids).logits[0, :-1].float(), -1)
                out.append(lp.gather(1, ids[0, 1:, None])[:, 0].cpu().numpy().astype(np.float64))
        return out

    want = teacher_forced(torch.float32)
    eager = np.concatenate([np.abs(b - w) for b, w in zip(teacher_forced(torch.bfloat16), want)])
    mean_limit, max_limit = 1.25 * float(eager.mean()) + 0.02, 2.0 * float(eager.max()) + 0.1
    for backend in backends:
        check = f"{arch} bf16 teacher-forced {backend}"
        try:
            runner = ModelRunner(
                str(model_dir),
                num_blocks=96,
                block_size=4,
                device=dev,
                dtype=torch.bfloat16,
                grammar=False,
                **backend_kwargs(backend),
            )
            engine = Engine.build(runner, model_dir, max_batch_prefill_tokens=64)
            reqs = [request(str(i), s, 1, prompt_logprobs=True) for i, s in enumerate(seqs)]
            outputs = engine.run({0: reqs})
        except Exception as e:
            rep.add(2, check, "fail", f"{type(e).__name__}: {e}")
            continue
        diffs = []
        for i, w in enumerate(want):
            got = np.asarray(outputs[str(i)].prompt_logprobs, dtype=np.float64)[-len(w) :]
            diffs.append(np.abs(got - w))
        d = np.concatenate(diffs)
        worst, mean = float(d.max()), float(d.mean())
        ok = mean <= mean_limit and worst <= max_limit
        detail = (
            f"|Δ logprob| from float32: mean {mean:.3f} (≤ {mean_limit:.3f}), max {worst:.3f} (≤ {max_limit:.3f}) "
            f"over {len(d)} positions; eager bf16: mean {eager.mean():.3f}, max {eager.max():.3f}"
        )
        rep.add(2, check, "ok" if ok else "fail", detail, mean_abs=mean, max_abs=worst)


# ------------------------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------------------------
def served_imports() -> list[str]:
    return [m for m in SERVED_MODULES if importlib.util.find_spec(m) is None]


def install_wheels(work: Path) -> str:
    """Install the serving packages this machine lacks from .gpu-wheels (scripts/gpu_wheels.sh) into a folder
    on sys.path and PYTHONPATH; returns what is still missing, or ''."""
    missing = served_imports()
    if not missing:
        return ""
    if not WHEELS.is_dir():
        return f"missing {missing}; no {WHEELS.name}/ (scripts/gpu_wheels.sh, then carry it)"
    site = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    cmd += sorted(str(w) for w in WHEELS.glob("*.whl"))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return f"pip install from {WHEELS.name}/ failed: {done.stderr[-400:]}"
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    missing = served_imports()
    return f"still missing after install: {missing}" if missing else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_tokens(url: str, text: str, max_new: int) -> list[int]:
    body = json.dumps({"inputs": text, "parameters": {"max_new_tokens": max_new}}).encode()
    req = urllib.request.Request(url + "/generate_stream", body, {"Content-Type": "application/json"})
    ids = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    return ids


def phase4(rep: Report, dev: torch.device, quick: bool, work: Path) -> None:
    from transformers import AutoTokenizer

    why = install_wheels(work)
    if why:
        rep.skip(4, "served", why)
        return
    model_dir = tiny_dirs(work / "tiny")["llama"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()
    texts = [" ".join(words[i % 5 : i % 5 + 3 + 2 * i]) for i in range(4 if quick else 16)]
    max_new = 8 if quick else 24
    runner = ModelRunner(str(model_dir), num_blocks=256, block_size=16, device=dev, grammar=False)
    engine = Engine.build(runner, model_dir)
    outputs = engine.run({0: [request(str(i), tok(t).input_ids, max_new) for i, t in enumerate(texts)]})
    expected = [outputs[str(i)].tokens for i in range(len(texts))]
    del runner, engine

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "serve.log"
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "--model-id", str(model_dir), "--dtype", "float32"]
    cmd += ["--port", str(port), "--hostname", "127.0.0.1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        t = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited {proc.returncode}: {log_path.read_text()[-800:]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t > 180:
                raise TimeoutError(f"not healthy after 180 s: {log_path.read_text()[-800:]}")
            time.sleep(0.2)
        healthy_s = time.monotonic() - t
        got: dict[int, list[int] | str] = {}

        def one(i: int) -> None:
            try:
                got[i] = stream_tokens(url, texts[i], max_new)
            except Exception as e:
                got[i] = f"{type(e).__name__}: {e}"

        t = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        load_s = time.monotonic() - t
        wrong = [i for i in range(len(texts)) if got[i] != expected[i]]
        detail = f"healthy in {healthy_s:.1f} s; {len(texts)} concurrent streams in {load_s:.2f} s"
        detail += f"; differ from the in-process run: {[(i, got[i]) for i in wrong][:3]}" if wrong else "; tokens equal"
        rep.add(4, "served", "fail" if wrong else "ok", detail, healthy_s=healthy_s, load_s=load_s, differ=wrong)
    except Exception as e:
        rep.add(4, "served", "fail", f"{type(e).__name__}: {e}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        (rep.out / "serve.log").write_text(log_path.read_text(errors="replace")[-200_000:])


# ------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--phase", type=int, action="append", choices=PHASES, help="phases to run (repeat); all if none")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: runs on a CPU in seconds")
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ap.add_argument("--speed-budget", type=float, default=210.0, help="seconds phase 3 may take (then it skips)")
    args = ap.parse_args(argv)
    phases = sorted(set(args.phase or PHASES))
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 identity needs plain float32 products
    torch.backends.cudnn.allow_tf32 = False
    rep = Report(args.out, phases)
    rep.meta.update(device=str(dev), quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        for phase in phases:
            t = time.monotonic()
            try:
                if phase == 0:
                    phase0(rep, dev, args.quick)
                elif phase == 1:
                    phase1(rep, dev, args.quick)
                elif phase == 2:
                    phase2(rep, dev, args.quick, work)
                elif phase == 3:
                    phase3(rep, dev, args.quick, args.speed_budget)
                else:
                    phase4(rep, dev, args.quick, work)
            except Exception as e:  # one phase's crash leaves the others to run
                rep.add(phase, "phase", "fail", f"{type(e).__name__}: {e}")
            rep.meta[f"phase{phase}_s"] = round(time.monotonic() - t, 1)
            rep.write()
    failed = [r for r in rep.rows if r["status"] == "fail" and r["phase"] in phases]
    print(f"{len(failed)} failed; {rep.md_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
