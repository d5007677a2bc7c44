"""The vision workload's flood check: text streams decode while image requests arrive, against the same streams
alone (rounds in ABBA order). The server's --max-batch-size equals the streams, so the flood's requests are
fetched, decoded and preprocessed by the tokenizer processes and queued, but not prefilled while the streams run:
the gap ratio is what the image path outside the model costs decoding; each process's CPU seconds in the window say
where the flood went."""

from __future__ import annotations

import asyncio
import time

from bench import clock, machine
from bench.serving import cpu_cost, loadgen
from bench.workloads.vision.ledger import Ledger, delta, scrape
from bench.workloads.vision.model import DIALECT, Jobs
from bench.workloads.vision.report import ms, say


async def _until_running(url: str, want: int, streams: list[asyncio.Task], timeout: float = 600) -> None:
    """Poll /metrics until `want` requests run (the streams all decode), or fail."""
    deadline = time.monotonic() + timeout
    async with loadgen.aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if any(t.done() for t in streams):
                raise RuntimeError(f"a stream ended before /metrics showed all {want} running: give them more tokens "
                                   "(--vision-stream-tokens)")  # fmt: skip
            _, batch = loadgen.kv_and_batch(await scrape(session, url))
            if batch is not None and batch >= want:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{want} streams never ran at once")


async def _until_idle(url: str, timeout: float = 300) -> None:
    """Poll /metrics until nothing runs or waits (the flood's aborted requests gone)."""
    deadline = time.monotonic() + timeout
    async with loadgen.aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            m = await scrape(session, url)
            if not m.get("tgi_batch_current_size") and not m.get("tgi_queue_size"):
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("the server never went idle after the flood")


async def _flood(url: str, pool: list[str], rate: float, prompt: str, sent: list[float]) -> None:
    """Image requests (one new token each) at `rate` per second until cancelled; cancelling closes them (the server
    aborts what it queued)."""

    async def one(session, uri: str) -> None:
        body = {"inputs": f"![]({uri})\n{prompt}", "parameters": {"max_new_tokens": 1}}
        async with session.post(url + "/generate_stream", json=body) as resp:
            await resp.read()

    tasks = []
    try:
        async with loadgen.aiohttp.ClientSession(connector=loadgen.aiohttp.TCPConnector(limit=0)) as session:
            start = time.monotonic()
            while True:
                i = len(sent)
                sent.append(time.monotonic())
                tasks.append(asyncio.ensure_future(one(session, pool[i % len(pool)])))
                await asyncio.sleep(max(0.0, start + (i + 1) / rate - time.monotonic()))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _streams_round(url: str, ledger: Ledger, jobs: list[loadgen.Job], flood: dict | None, root: int) -> dict:
    """The streams' gaps from the moment all run to the moment the first one ends, with or without the flood; each
    process's CPU seconds over that window."""
    tasks = [asyncio.ensure_future(loadgen.drive(url, DIALECT, [job], 1)) for job in jobs]
    await _until_running(url, len(jobs), tasks)
    ledger.sent(len(jobs))
    before = await ledger.counted()
    cpu = cpu_cost.ProcessCpu(root)
    cpu.start()
    start = clock.wall()
    sent: list[float] = []
    flooding = asyncio.ensure_future(_flood(url, **flood, sent=sent)) if flood else None
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    end = clock.wall()
    used = cpu.stop()
    if flooding:
        flooding.cancel()
        await asyncio.gather(flooding, return_exceptions=True)
    results = await asyncio.gather(*tasks)
    ledger.sent(len(sent))
    after = await ledger.counted(timeout=10)  # every flood request counted (one cancelled unread: not after 10 s)
    gaps = []
    for (sample,), _, _ in results:
        if sample.error is not None:
            raise RuntimeError(f"a stream failed: {sample.error}")
        per = sample.gaps()
        k = round(len(per) / max(1, len(sample.events) - 1))  # gaps per event (an event may carry several tokens)
        ends = [e for e in sample.events[1:] for _ in range(k)]
        gaps += [g for g, e in zip(per, ends) if start < e <= end]
    moved = delta(after, before)
    return {"flood": bool(flood), "window_s": end - start, "gaps": gaps, "itl_p50_ms": ms(gaps, 50),
            "load_1m": machine.load()[0], "flood_sent": len(sent),
            "flood_preprocessed": moved["switchyard_request_images_sum"],
            "preprocess_s": moved["switchyard_image_preprocess_seconds_sum"],
            "cpu_s": {role: round(s, 3) for role, s in sorted(used.items(), key=lambda kv: -kv[1])}}  # fmt: skip


async def check(url: str, ledger: Ledger, jobs: Jobs, args, root: int) -> dict:
    """The streams' gaps alone and with the flood, rounds in ABBA order; the ratios of the pooled gaps."""
    pool = [jobs.pictures.uri() for _ in range(32)]
    prompt = jobs.prompts.make(args.vision_prompt_tokens)[0]
    # unmeasured: a flood request and the streams' batch shape once, so that no round pays for a first use
    warm = [loadgen.Job(f"![]({pool[0]})\n{prompt}", jobs.image_prompt_tokens, 1)]
    warm += jobs.prompts.fixed(args.vision_streams, 64, 2)
    await loadgen.drive(url, DIALECT, warm, len(warm))
    ledger.sent(len(warm), 1)
    order = [False, True, True, False] * (args.vision_flood_rounds // 4) + [False, True, True][
        : args.vision_flood_rounds % 4
    ]
    rounds = []
    for flooded in order:
        await _until_idle(url)
        streams = jobs.prompts.fixed(args.vision_streams, 64, args.vision_stream_tokens)
        flood = {"pool": pool, "rate": args.vision_flood_rate, "prompt": prompt} if flooded else None
        r = await _streams_round(url, ledger, streams, flood, root)
        say(f"  {'flood' if flooded else 'alone':<5} {len(r['gaps']):5d} gaps in {r['window_s']:5.1f} s  "
             f"p50 {ms(r['gaps'], 50) or 0:6.1f} ms  images sent {r['flood_sent']:4d}, preprocessed "
             f"{r['flood_preprocessed']:4.0f}")  # fmt: skip
        rounds.append(r)
    await _until_idle(url)
    out = {"streams": args.vision_streams, "stream_tokens": args.vision_stream_tokens, "rate": args.vision_flood_rate,
           "rounds": [{k: v for k, v in r.items() if k != "gaps"} for r in rounds]}  # fmt: skip
    for name, flooded in (("alone", False), ("flood", True)):
        gaps = [g for r in rounds if r["flood"] == flooded for g in r["gaps"]]
        window = sum(r["window_s"] for r in rounds if r["flood"] == flooded)
        cpu: dict[str, float] = {}
        for r in rounds:
            if r["flood"] == flooded:
                for role, s in r["cpu_s"].items():
                    cpu[role] = cpu.get(role, 0.0) + s
        out[name] = {"gaps": len(gaps), "window_s": window, "itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99),
                     "itl_mean_ms": 1000 * sum(gaps) / len(gaps) if gaps else None,
                     "cpu_per_s": {role: s / window for role, s in sorted(cpu.items(), key=lambda kv: -kv[1])}
                     if window else {},
                     "images_preprocessed": sum(r["flood_preprocessed"] for r in rounds if r["flood"] == flooded),
                     "images_sent": sum(r["flood_sent"] for r in rounds if r["flood"] == flooded),
                     # the shard's CPU per model step (a step gives each stream a token): the same work per step
                     # with less CPU to do it in, or more work per step
                     "shard_cpu_ms_per_step": 1000 * cpu.get("shard", 0.0) * args.vision_streams / len(gaps)
                     if gaps else None}  # fmt: skip
    for key in ("itl_p50_ms", "itl_mean_ms", "itl_p99_ms", "shard_cpu_ms_per_step"):
        a, f = out["alone"][key], out["flood"][key]
        out[f"ratio_{key.removeprefix('itl_').removesuffix('_ms')}"] = f / a if a and f is not None else None
    return out
