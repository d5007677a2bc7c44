"""Phase 2, identity: the tiny architectures through ModelRunner and the in-process engine token-identical to
transformers' generate() in float32, and bf16 teacher-forced within tolerance; and the tiny models they use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner

from .common import attention_backends, backend_kwargs, triton_module
from .report import Report


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
