"""The long-prompt workload's in-process half: the model driven through the in-process engine (bench/engine.py: the
real Batcher and ModelRunner, no bus), step by step.

- `chunk_sweep`: per cap on the prefill while decoding (tokens, or a time such as "300ms"), the step times of
  `streams` decoding streams just before and while one long prompt is fed beside them, in wall and CPU seconds;
- `memory_probe`: one very long prompt fed `chunk` tokens a step: each chunk's seconds and the process's peak RSS
  above the RSS just before it.
Both run from `switchyard bench --workload long-prompt` (bench/workloads/long_prompt.py), which prints their tables:

    switchyard bench --workload long-prompt --model smollm2 --long-engines '' --long-prompts '' \\
        --long-chunks 0,512,256,128,150ms,300ms --long-itl-prompt 4096
"""

from __future__ import annotations

from pathlib import Path

from bench import clock, machine


def _say(msg: str) -> None:
    print(msg, flush=True)


def _engine(model_dir: Path, dtype: str, num_blocks: int, **batcher_kwargs):
    """A ModelRunner of `num_blocks` KV blocks and an engine over it (no EOS: requests run to their length)."""
    import torch

    from bench.engine import Engine
    from services.scheduler.batcher import Batcher
    from services.shard.model_runner import ModelRunner

    machine.shard_threads()
    runner = ModelRunner(str(model_dir), num_blocks=num_blocks, block_size=16, dtype=getattr(torch, dtype))
    return Engine(runner, Batcher(num_blocks, eos_ids=set(), block_size=16, **batcher_kwargs), wire=False)


def chunk_sweep(model_dir: Path, dtype: str, caps: list[str], streams: int, long_tokens: int) -> list[dict]:
    """Per cap: the step times of `streams` decoding streams just before and while a `long_tokens` prompt is fed.
    A cap is a token count (--max-prefill-tokens-while-decoding; 0: none) or a time ("200ms":
    --max-prefill-ms-while-decoding, the token cap off)."""
    import numpy as np

    from bench.engine import request

    block, base, stream_ctx = 16, 8, 32 + 1200  # streams live through every phase: prompt 32, ≤1200 new tokens
    num_blocks = streams * -(-stream_ctx // block) + -(-(long_tokens + 1) // block) + 4
    # the long prompt joins at the next step (the Batcher's default, as in the server); the step budget fits the
    # whole prompt beside the decodes, so cap 0 feeds it in one step
    engine = _engine(model_dir, dtype, num_blocks, max_batch_size=streams + 1,
                     max_batch_prefill_tokens=long_tokens + streams, prefix_caching=False)  # fmt: skip
    b = engine.batcher
    vocab = engine.runner.model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    fed: dict[str, int] = {}

    def on_step(plan, result) -> None:  # before the Batcher applies the result: every planned row still runs
        fed.clear()
        for s, n in zip(plan.seqs.tolist(), plan.num_tokens.tolist()):
            if s in b.running:
                fed[b.running[s].req.request_id] = n

    engine.on_step = on_step
    cpu_times: list[float] = []  # the process's CPU seconds per step: steadier than wall time on a shared machine

    def one_step() -> tuple[float, dict[str, int], list]:
        with clock.Lap() as lap:
            emitted = engine.step()
        cpu_times.append(lap.cpu)
        return lap.wall, dict(fed), emitted or []

    for i in range(streams):
        engine.add(request(f"s{i}", rng.integers(3, vocab, 32), stream_ctx - 32))
    for _ in range(3):  # prefill the streams, then two decode steps (first-call costs)
        one_step()
    rows = []
    for k, cap in enumerate(caps):
        timed = cap.endswith("ms")
        b.pacing.max_tokens, b.pacing.max_ms = (0, float(cap[:-2])) if timed else (int(cap), 0.0)
        before = [one_step()[0] for _ in range(base)]
        cpu_before = cpu_times[-base:]
        engine.add(request(f"long{k}", rng.integers(3, vocab, long_tokens), 1))
        during, chunks, done, first = [], [], False, len(cpu_times)
        while not done:
            took, fed_now, emitted = one_step()
            during.append(took)
            chunks.append(fed_now.get(f"long{k}", 0))
            done = any(e.seq.req.request_id == f"long{k}" for e in emitted)
        rows.append({"cap": cap if timed else int(cap), "streams": streams, "long_tokens": long_tokens,
                     "steps": len(during),
                     "chunks": chunks, "itl_alone_p50_ms": clock.p50_ms(before),
                     "itl_during_p50_ms": clock.p50_ms(during), "itl_during_max_ms": max(during) * 1000,
                     "long_prefill_s": sum(during), "cpu_alone_p50_ms": clock.p50_ms(cpu_before),
                     "cpu_during_p50_ms": clock.p50_ms(cpu_times[first:]),
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


def _status_kib(field: str) -> int:
    line = next(ln for ln in open("/proc/self/status") if ln.startswith(field + ":"))
    return int(line.split()[1])


def memory_probe(model_dir: Path, dtype: str, tokens: int, chunk: int) -> dict:
    """One `tokens`-token prompt fed `chunk` tokens a step: per chunk its seconds and the process's peak RSS during
    it (VmHWM, reset before each step) above the RSS just before it: what one chunk needs beyond the weights and
    the KV written so far (the KV cache is zero-filled lazily, so the RSS itself grows by each chunk's KV pages,
    reported as `rss_mib`)."""
    import numpy as np

    from bench.engine import request

    engine = _engine(model_dir, dtype, -(-(tokens + 1) // 16) + 1, max_batch_size=1, max_batch_prefill_tokens=chunk)
    vocab = engine.runner.model.config.get_text_config().vocab_size
    engine.add(request("long", np.random.default_rng(0).integers(3, vocab, tokens), 1))
    plans = []
    engine.on_step = lambda plan, result: plans.append(plan)
    loaded = _status_kib("VmRSS")
    chunks, token = [], None
    while token is None:
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS: the next reading is this step's peak
        with clock.Lap() as lap:
            emitted = engine.step()
        peak = _status_kib("VmHWM")
        plan = plans[-1]
        c = {"context": int(plan.context_lens[0]), "tokens": int(plan.num_tokens[0]), "s": lap.wall,
             "peak_mib": (peak - before) / 1024, "hwm_mib": peak / 1024,
             "rss_mib": _status_kib("VmRSS") / 1024}  # fmt: skip
        chunks.append(c)
        _say(f"  memory probe: chunk at {c['context']:>6} +{c['tokens']:>5} tokens: {lap.wall:7.2f} s, peak "
             f"{c['peak_mib']:7.1f} MiB above the RSS before it, RSS after {c['rss_mib']:.0f} MiB")  # fmt: skip
        token = emitted[0].token_id if emitted else None
    return {"tokens": tokens, "chunk": chunk, "loaded_rss_mib": loaded / 1024, "chunks": chunks, "token": token,
            "prefill_s": sum(c["s"] for c in chunks),
            "max_peak_mib": max(c["peak_mib"] for c in chunks),
            "hwm_mib": max(c["hwm_mib"] for c in chunks)}  # fmt: skip
