"""Peer: transformers' own continuous batching (`model.generate_batch`), in a process of its own.

Reads {"model", "dtype", "concurrency", "jobs": [[prompt, max_new_tokens], ...]} as JSON on stdin; prints the
same summary the load generator makes (output tok/s, TTFT and inter-token percentiles), from transformers'
own per-token timestamps. Requests are all submitted at once with at most `concurrency` in a batch, as
`concurrency` closed-loop clients would keep them. No HTTP and no tokenizer process: an in-process peer.

    python -m bench.serving.peer_hf < spec.json   # as suite.py runs it
"""

from __future__ import annotations

import json
import sys


def run(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    from bench import clock, machine
    from bench.serving.loadgen import Sample, summarize

    machine.shard_threads()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model.eval()
    jobs = spec["jobs"]
    inputs = [tok(prompt).input_ids for prompt, _ in jobs]
    # one max_new_tokens per batch call: group the jobs by it (a fixed workload is one group)
    groups: dict[int, list[int]] = {}
    for i, (_, n) in enumerate(jobs):
        groups.setdefault(n, []).append(i)
    cb = ContinuousBatchingConfig(max_requests_per_batch=spec["concurrency"], seed=0)
    # a first small call outside the timing: lazy initialisation, first-call allocations
    warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs[:1], generation_config=warm, continuous_batching_config=cb)
    samples: list[Sample] = []
    generating = 0.0  # summed over calls: first request created → last token of the call
    started = clock.wall()
    for n, idx in groups.items():
        gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs = model.generate_batch(
            [inputs[i] for i in idx], generation_config=gen, continuous_batching_config=cb, record_timestamps=True
        )
        group = []
        for out in outs.values():
            s = Sample(sent=out.created_time, prompt_tokens=len(out.prompt_ids))
            s.events = list(out.timestamps or [])
            s.tokens = len(out.generated_tokens)
            s.error = out.error
            group.append(s)
        # throughput over the generation itself, not the manager's start and stop around each generate_batch
        # call (a mixed workload needs one call per max_new_tokens), which is not per-token work
        ends = [s.events[-1] for s in group if s.events]
        if ends:
            generating += max(ends) - min(s.sent for s in group)
        samples += group
    ended = clock.wall()
    res = summarize(samples, 0.0, generating or ended - started)
    res["call_wall_s"] = ended - started
    res["concurrency"] = spec["concurrency"]
    return res


if __name__ == "__main__":
    json.dump(run(json.load(sys.stdin)), sys.stdout)
    print()
