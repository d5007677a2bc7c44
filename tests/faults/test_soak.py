"""Soak: a bounded run of mixed traffic with disconnects and bad requests, the RSS and open fds of every
server process sampled from /proc all along. After warm-up the memory is flat, at the end nothing waits or runs
anywhere, every KV block is free, the run directory holds the files it held before, no 5xx was answered, and every
process is the one that started (no crash, no restart).

SWITCHYARD_SOAK_MINUTES sets the length (default 3, so `make test-faults` stays short; the full soak is 20:
`SWITCHYARD_FAULTS=1 SWITCHYARD_SOAK_MINUTES=20 .venv/bin/python -m pytest -q -s tests/faults/test_soak.py`).
The series (JSON) and a plot (PNG) are written to .bench/soak-<time>/, and a table is printed.

Memory bound: after warm-up, the median of the last third of the run may exceed the median of the first third
after warm-up by at most max(32 MiB, 10 %) per process. Medians over many samples, not single samples, so one
allocation burst (a long batch, glibc keeping an arena) does not fail the test; 32 MiB is above the noise seen
between two idle-vs-busy samples of these processes (torch and the allocators keep freed memory), while a per-
request leak of a few KB over the tens of thousands of requests of a 20-minute run is well past it."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import re
import statistics
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import requests

from tests.e2e.server import ROOT, Server
from tests.e2e.test_disconnects import WORDS, assert_no_ghosts, disconnect_once, settled

pytestmark = pytest.mark.e2e

MINUTES = float(os.environ.get("SWITCHYARD_SOAK_MINUTES", "3"))
CONCURRENCY = 12
SEED = 20240607
WARMUP = 0.2  # fraction of the run before memory is expected to be flat
MIB = 1 << 20
FD_SLACK = 16  # open fds may differ by a few sockets in flight; a leak per request is far more


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir, tmp_path_factory):
    """A server of its own: the other fault tests kill processes, which would spoil the comparison."""
    log = tmp_path_factory.mktemp("logs") / "soak-server.log"
    with Server(
        tiny_model_dir, log, "--max-total-tokens", "512", "--max-input-tokens", "400", clean_log=False
    ) as server:  # the invalid requests log their errors on purpose
        yield server


# --------------------------------------------------------------------------------------------
# Processes and their memory


def server_processes(server: Server) -> dict[str, int]:
    """name → pid of every process of the server: the launcher, supervisord and each program."""
    procs = {"launcher": server.proc.pid, "supervisord": int((Path(server.run_dir()) / "supervisord.pid").read_text())}
    for info in server.rpc("getAllProcessInfo"):
        procs[info["name"]] = info["pid"]
    return procs


def rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def gauges(url: str) -> dict[str, float]:
    """The queue and KV gauges of /metrics (summed over label sets: all replicas, all hops)."""
    text = requests.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = collections.defaultdict(float)
    names = ("tgi_queue_size", "tgi_batch_current_size", "switchyard_kv_blocks_used", "switchyard_hop_queue_depth")
    for name, value in re.findall(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        if name in names:
            out[name] += float(value)
    return dict(out)


def drained(url: str, timeout: float = 60.0) -> dict[str, float]:
    """The gauges once all are zero (a process's metrics text rides its heartbeat, rate-limited to a few
    seconds: the load fields `settled` reads are fresher), or the last seen after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(url)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


class Sampler(threading.Thread):
    """Every `period` seconds: RSS and fds of each process (from /proc) and the queue gauges (from /metrics)."""

    def __init__(self, url: str, procs: dict[str, int], period: float):
        super().__init__(daemon=True)
        self.url, self.procs, self.period = url, procs, period
        self.t0 = time.monotonic()
        self.times: list[float] = []
        self.rss: dict[str, list[int]] = {n: [] for n in procs}
        self.fds: dict[str, list[int]] = {n: [] for n in procs}
        self.queues: list[dict[str, float]] = []
        self.errors: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.period if self.times else 0):
            self.times.append(time.monotonic() - self.t0)
            for name, pid in self.procs.items():
                try:
                    rss, fds = rss_and_fds(pid)
                except OSError as e:  # the process is gone: recorded, and the test fails on it
                    self.errors.append(f"{name} (pid {pid}) at {self.times[-1]:.0f}s: {e}")
                    rss, fds = 0, 0
                self.rss[name].append(rss)
                self.fds[name].append(fds)
            try:
                self.queues.append(gauges(self.url))
            except requests.RequestException as e:
                self.errors.append(f"/metrics at {self.times[-1]:.0f}s: {e}")
                self.queues.append({})


# --------------------------------------------------------------------------------------------
# Traffic


class Tally:
    def __init__(self):
        self.by_kind: collections.Counter = collections.Counter()
        self.status: collections.Counter = collections.Counter()
        self.server_errors: list[str] = []
        self.tokens = 0

    def record(self, kind: str, status: int, body: str = "") -> None:
        self.by_kind[kind] += 1
        self.status[status] += 1
        if status >= 500:
            self.server_errors.append(f"{kind} {status}: {body[:200]}")


def prompt(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(WORDS))
    return " ".join(WORDS[(start + i * 7) % len(WORDS)] for i in range(words))


def invalid(rng: random.Random) -> tuple[str, dict | bytes]:
    """A request TGI answers with a 4xx: each kind of validation error, plus broken bodies."""
    return rng.choice(
        [
            ("/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 0}}),
            ("/generate", {"inputs": "hello", "parameters": {"temperature": -1.0}}),
            ("/generate", {"inputs": "hello", "parameters": {"top_p": 1.5}}),
            ("/generate", {"inputs": prompt(rng, 700), "parameters": {"max_new_tokens": 5}}),  # > max input tokens
            ("/generate_stream", {"inputs": "hello", "parameters": {"max_new_tokens": 600}}),  # > max total tokens
            ("/generate", b'{"inputs": "unterminated'),
            ("/v1/chat/completions", {"messages": "not a list"}),
            ("/v1/completions", {"prompt": "x", "max_tokens": -3}),
        ]
    )


async def one_request(session: aiohttp.ClientSession, port: int, rng: random.Random, tally: Tally) -> None:
    url = f"http://127.0.0.1:{port}"
    kind = rng.choices(
        ["generate", "stream", "chat", "chat_stream", "completions_stream", "disconnect", "invalid"],
        weights=[3, 3, 2, 2, 2, 3, 1],
    )[0]
    text, n = prompt(rng, rng.randint(1, 60)), rng.randint(1, 64)
    if kind == "disconnect":
        how = rng.choice(["stream", "chat", "immediate", "immediate_stream", "blocking", "partial_body"])
        await disconnect_once(port, how, text, rng, max_new_tokens=rng.randint(20, 300))
        tally.by_kind[f"disconnect:{how}"] += 1
        return
    if kind == "invalid":
        path, body = invalid(rng)
    elif kind in ("generate", "stream"):
        path = "/generate" if kind == "generate" else "/generate_stream"
        params = {"max_new_tokens": n, "details": rng.random() < 0.5}
        if rng.random() < 0.5:  # sampled as well as greedy
            params.update(do_sample=True, temperature=0.8, top_k=20, seed=rng.randrange(1 << 30))
        body = {"inputs": text, "parameters": params}
    elif kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"model": "tgi", "messages": [{"role": "user", "content": text}], "max_tokens": n}
        body["stream"] = kind == "chat_stream"
    else:
        path = "/v1/completions"
        body = {"model": "tgi", "prompt": text, "max_tokens": n, "stream": True}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with session.post(url + path, data=data, headers=headers) as r:
        raw = await r.read()
    tally.record(kind, r.status, raw.decode(errors="replace"))
    if kind != "invalid" and r.status != 200:
        tally.server_errors.append(f"{kind} answered {r.status}: {raw[:200]!r}")  # valid requests must succeed
    # TGI answers a stream's validation error as its one event (200); everything else invalid is a 4xx
    in_stream = r.status == 200 and raw.startswith(b"data:") and b'"error_type":"validation"' in raw
    if kind == "invalid" and not (400 <= r.status < 500 or in_stream):
        tally.server_errors.append(f"invalid {path} answered {r.status}: {raw[:200]!r}")
    if r.status == 200 and (kind.endswith("stream") and b"data:" not in raw):
        tally.server_errors.append(f"{kind}: a stream without events: {raw[:200]!r}")


async def traffic(port: int, seconds: float, seed: int) -> Tally:
    tally, deadline = Tally(), time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=120)

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)  # each worker its own stream: reproducible whatever the interleaving
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                await one_request(session, port, rng, tally)

    await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    return tally


# --------------------------------------------------------------------------------------------
# Report


def run_dir_listing(path: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files}


def windows(sampler: Sampler) -> tuple[int, int, int]:
    """Sample indexes: warm-up end, end of the first third after it, start of the last third."""
    n = len(sampler.times)
    warm = int(n * WARMUP)
    third = (n - warm) // 3
    return warm, warm + third, n - third


def memory_table(sampler: Sampler) -> list[dict]:
    warm, first_end, last_start = windows(sampler)
    rows = []
    for name, series in sampler.rss.items():
        base = statistics.median(series[warm:first_end])
        end = statistics.median(series[last_start:])
        fds = sampler.fds[name]
        rows.append(
            {
                "process": name,
                "start_mib": series[0] / MIB,
                "warm_mib": base / MIB,
                "end_mib": end / MIB,
                "growth_mib": (end - base) / MIB,
                "bound_mib": max(32 * MIB, 0.10 * base) / MIB,
                "fds_warm": int(statistics.median(fds[warm:first_end])),
                "fds_end": int(statistics.median(fds[last_start:])),
            }
        )
    return rows


def write_report(sampler: Sampler, rows: list[dict], tally: Tally, extra: dict) -> Path:
    out = ROOT / ".bench" / time.strftime("soak-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    series = {
        "minutes": MINUTES,
        "concurrency": CONCURRENCY,
        "seed": SEED,
        "t": sampler.times,
        "rss_bytes": sampler.rss,
        "open_fds": sampler.fds,
        "queues": sampler.queues,
        "summary": rows,
        "requests": dict(tally.by_kind),
        "status": {str(k): v for k, v in tally.status.items()},
        **extra,
    }
    (out / "series.json").write_text(json.dumps(series, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axq) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, height_ratios=[3, 1])
    for name, values in sampler.rss.items():
        ax.plot(sampler.times, [v / MIB for v in values], label=name)
    warm = sampler.times[windows(sampler)[0]]
    ax.axvline(warm, color="grey", linestyle="--", label="end of warm-up")
    ax.set_ylabel("RSS (MiB)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(f"Switchyard soak: {MINUTES:g} min, {CONCURRENCY} clients")
    for name in ("tgi_queue_size", "tgi_batch_current_size", "switchyard_kv_blocks_used"):
        axq.plot(sampler.times, [q.get(name, float("nan")) for q in sampler.queues], label=name)
    axq.set_xlabel("seconds")
    axq.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(MINUTES * 60 + 600)  # the run itself plus server start, settling and the report
def test_soak_memory_flat_nothing_left_behind(soak_server):
    url, port = soak_server.url, soak_server.port
    procs = server_processes(soak_server)
    assert len(procs) >= 7 and all(procs.values()), procs  # launcher, supervisord, 5 roles at least
    files_before = run_dir_listing(soak_server.run_dir())
    seconds = MINUTES * 60
    sampler = Sampler(url, procs, period=max(2.0, seconds / 200))
    sampler.start()
    started = time.monotonic()
    tally = asyncio.run(traffic(port, seconds, SEED))
    elapsed = time.monotonic() - started
    sampler.halt.set()
    sampler.join()

    state = settled(url, timeout=120)  # two equal heartbeats in a row, nothing running
    final = drained(url)
    files_after = run_dir_listing(soak_server.run_dir())
    after = server_processes(soak_server)
    health = requests.get(url + "/health", timeout=10).status_code

    rows = memory_table(sampler)
    served = sum(v for k, v in tally.by_kind.items() if not k.startswith(("disconnect", "invalid")))
    disconnects = sum(v for k, v in tally.by_kind.items() if k.startswith("disconnect"))
    out = write_report(
        sampler,
        rows,
        tally,
        {
            "served": served,
            "disconnects": disconnects,
            "elapsed_s": elapsed,
            "final_gauges": final,
            "state": state,
            "run_dir_files": sorted(files_after),
            "run_dir_files_before": sorted(files_before),
        },
    )
    print(
        f"\nsoak {MINUTES:g} min ({elapsed:.0f}s), {CONCURRENCY} clients: {served} served, {disconnects} disconnects,"
    )
    print(f"  {tally.by_kind['invalid']} invalid; status {dict(sorted(tally.status.items()))}; report in {out}")
    print(f"  {'process':16s} {'start':>8s} {'warm':>8s} {'end':>8s} {'growth':>8s} {'bound':>7s}  fds warm→end")
    for r in rows:
        print(
            f"  {r['process']:16s} {r['start_mib']:7.1f}M {r['warm_mib']:7.1f}M {r['end_mib']:7.1f}M"
            f" {r['growth_mib']:+7.1f}M {r['bound_mib']:6.0f}M  {r['fds_warm']}→{r['fds_end']}"
        )

    assert not sampler.errors, sampler.errors[:5]
    assert after == procs, f"a process restarted or vanished: {procs} → {after}"
    assert health == 200
    assert not tally.server_errors, f"{len(tally.server_errors)} bad answers: {tally.server_errors[:5]}"
    assert served > 0 and disconnects > 0 and tally.by_kind["invalid"] > 0, tally.by_kind
    assert_no_ghosts(state)
    for name in ("tgi_queue_size", "tgi_batch_current_size", "switchyard_kv_blocks_used", "switchyard_hop_queue_depth"):
        assert final.get(name, 0) == 0, f"{name} is {final.get(name)} after the traffic stopped"
    assert files_after == files_before, f"run directory: +{files_after - files_before} -{files_before - files_after}"
    for r in rows:
        assert r["growth_mib"] < r["bound_mib"], f"{r['process']} grew {r['growth_mib']:.1f} MiB after warm-up: {r}"
        assert r["fds_end"] - r["fds_warm"] <= FD_SLACK, f"{r['process']} open fds grew: {r}"
