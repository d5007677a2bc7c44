"""The long-prompt workload's in-process parts (the real Batcher driving the real ModelRunner, no bus): the sweep of
the prefill cap while decoding, and the memory probe of one very long prompt fed in chunks."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---- in process: the chunk sweep ------------------------------------------------------------------------------
def chunk_sweep(model_dir: Path, dtype: str, caps: list[str], streams: int, long_tokens: int) -> list[dict]:
    """Per cap: the step times of `streams` decoding streams just before and while a `long_tokens` prompt is fed.
    A cap is a token count (--max-prefill-tokens-while-decoding; 0: none) or a time ("200ms":
    --max-prefill-ms-while-decoding, the token cap off)."""
    import numpy as np
    import torch

    from libs.protocol.messages import TokenizedRequest
    from libs.protocol.params import SamplingParams
    from services.scheduler.batcher import Batcher
    from services.shard.model_runner import ModelRunner

    torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", os.cpu_count() or 1)))
    block, base, stream_ctx = 16, 8, 32 + 1200  # streams live through every phase: prompt 32, ≤1200 new tokens
    num_blocks = streams * -(-stream_ctx // block) + -(-(long_tokens + 1) // block) + 4
    runner = ModelRunner(str(model_dir), num_blocks=num_blocks, block_size=block, dtype=getattr(torch, dtype))
    vocab = runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    # the long prompt joins at the next step (the Batcher's default, as in the server); the step budget fits the
    # whole prompt beside the decodes, so cap 0 feeds it in one step
    b = Batcher(num_blocks, max_batch_size=streams + 1, max_batch_prefill_tokens=long_tokens + streams,
                eos_ids=set(), prefix_caching=False, block_size=block)  # fmt: skip
    step = 0

    def request(rid: str, n: int, max_new: int) -> TokenizedRequest:
        ids = rng.integers(3, vocab, n).astype(np.int32)
        return TokenizedRequest(request_id=rid, ingress=0, input_ids=ids, sampling=SamplingParams(),
                                max_new_tokens=max_new)  # fmt: skip

    cpu_times: list[float] = []  # the process's CPU seconds per step: steadier than wall time on a shared machine

    def one_step() -> tuple[float, dict[str, int], list]:
        nonlocal step
        step += 1
        plan = b.plan(step)
        t0, c0 = time.perf_counter(), time.process_time()
        result = runner.execute(plan)
        took = time.perf_counter() - t0
        cpu_times.append(time.process_time() - c0)
        fed = {b.running[s].req.request_id: n for s, n in zip(plan.seqs.tolist(), plan.num_tokens.tolist())
               if s in b.running}  # fmt: skip
        return took, fed, b.apply(result)

    for i in range(streams):
        b.add(request(f"s{i}", 32, stream_ctx - 32))
    for _ in range(3):  # prefill the streams, then two decode steps (first-call costs)
        one_step()
    rows = []
    for k, cap in enumerate(caps):
        timed = cap.endswith("ms")
        b.pacing.max_tokens, b.pacing.max_ms = (0, float(cap[:-2])) if timed else (int(cap), 0.0)
        before = [one_step()[0] for _ in range(base)]
        cpu_before = cpu_times[-base:]
        b.add(request(f"long{k}", long_tokens, 1))
        during, chunks, done, first = [], [], False, len(cpu_times)
        while not done:
            took, fed, emitted = one_step()
            during.append(took)
            chunks.append(fed.get(f"long{k}", 0))
            done = any(e.seq.req.request_id == f"long{k}" for e in emitted)
        rows.append({"cap": cap if timed else int(cap), "streams": streams, "long_tokens": long_tokens,
                     "steps": len(during),
                     "chunks": chunks, "itl_alone_p50_ms": statistics.median(before) * 1000,
                     "itl_during_p50_ms": statistics.median(during) * 1000, "itl_during_max_ms": max(during) * 1000,
                     "long_prefill_s": sum(during), "cpu_alone_p50_ms": statistics.median(cpu_before) * 1000,
                     "cpu_during_p50_ms": statistics.median(cpu_times[first:]) * 1000,
                     "cpu_during_max_ms": max(cpu_times[first:]) * 1000,
                     "long_prefill_cpu_s": sum(cpu_times[first:])})  # fmt: skip
        r = rows[-1]
        _say(f"  in process: cap {r['cap'] or 'none':>5}: {r['steps']:3d} steps, "
             f"ITL alone {r['itl_alone_p50_ms']:6.1f} ms, "
             f"during p50 {r['itl_during_p50_ms']:6.1f} / max {r['itl_during_max_ms']:7.1f} ms, "
             f"long prompt {r['long_prefill_s']:.2f} s; CPU time: alone {r['cpu_alone_p50_ms']:6.1f} ms, during p50 "
             f"{r['cpu_during_p50_ms']:6.1f} / max {r['cpu_during_max_ms']:7.1f} ms, long prompt "
             f"{r['long_prefill_cpu_s']:.2f} s")  # fmt: skip
    return rows


# ---- in process: one very long prompt, chunk by chunk ----------------------------------------------------------
def _status_kib(field: str) -> int:
    line = next(ln for ln in open("/proc/self/status") if ln.startswith(field + ":"))
    return int(line.split()[1])


def memory_probe(model_dir: Path, dtype: str, tokens: int, chunk: int) -> dict:
    """One `tokens`-token prompt fed `chunk` tokens a step by the real Batcher to the real ModelRunner: per chunk
    its seconds and the process's peak RSS during it (VmHWM, reset before each step) above the RSS just before it:
    what one chunk needs beyond the weights and the KV written so far (the KV cache is zero-filled lazily, so the
    RSS itself grows by each chunk's KV pages, reported as `rss_mib`)."""
    import numpy as np
    import torch

    from libs.protocol.messages import TokenizedRequest
    from libs.protocol.params import SamplingParams
    from services.scheduler.batcher import Batcher
    from services.shard.model_runner import ModelRunner

    torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", os.cpu_count() or 1)))
    block = 16
    num_blocks = -(-(tokens + 1) // block) + 1
    runner = ModelRunner(str(model_dir), num_blocks=num_blocks, block_size=block, dtype=getattr(torch, dtype))
    vocab = runner.model.config.get_text_config().vocab_size
    ids = np.random.default_rng(0).integers(3, vocab, tokens).astype(np.int32)
    b = Batcher(num_blocks, max_batch_size=1, max_batch_prefill_tokens=chunk, eos_ids=set(), block_size=block)
    b.add(TokenizedRequest(request_id="long", ingress=0, input_ids=ids, sampling=SamplingParams(), max_new_tokens=1))
    loaded = _status_kib("VmRSS")
    chunks, step, token = [], 0, None
    while token is None:
        step += 1
        plan = b.plan(step)
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS: the next reading is this step's peak
        t0 = time.perf_counter()
        result = runner.execute(plan)
        took = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
        c = {"context": int(plan.context_lens[0]), "tokens": int(plan.num_tokens[0]), "s": took,
             "peak_mib": (peak - before) / 1024, "hwm_mib": peak / 1024,
             "rss_mib": _status_kib("VmRSS") / 1024}  # fmt: skip
        chunks.append(c)
        _say(f"  memory probe: chunk at {c['context']:>6} +{c['tokens']:>5} tokens: {took:7.2f} s, peak "
             f"{c['peak_mib']:7.1f} MiB above the RSS before it, RSS after {c['rss_mib']:.0f} MiB")  # fmt: skip
        emitted = b.apply(result)
        token = emitted[0].token_id if emitted else None
    return {"tokens": tokens, "chunk": chunk, "loaded_rss_mib": loaded / 1024, "chunks": chunks, "token": token,
            "prefill_s": sum(c["s"] for c in chunks),
            "max_peak_mib": max(c["peak_mib"] for c in chunks),
            "hwm_mib": max(c["hwm_mib"] for c in chunks)}  # fmt: skip
