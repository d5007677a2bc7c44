"""Each server process's CPU seconds per 1,000 generated tokens over one measured level, from /proc (the
threads' schedstat, via bench.serving.pipeline): where the CPU goes beside the throughput, for Switchyard's
processes (shard, http, scheduler, …) and a peer's alike."""

from __future__ import annotations

import contextlib
import subprocess
import sys

from bench.serving.pipeline import cpu_and_switches, process_tree


class ProcessCpu:
    """CPU seconds of every process under `root` (the server's launcher), by role, between start() and stop()."""

    def __init__(self, root: int):
        self.root = root
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.roles = process_tree(self.root)
        self.before = {pid: cpu_and_switches(pid)[0] for pid in self.roles}

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, role in process_tree(self.root).items():
            used = cpu_and_switches(pid)[0] - self.before.get(pid, 0.0)
            name = role.removeprefix("services.")
            out[name] = out.get(name, 0.0) + max(0.0, used)
        return out


def per_1k_tokens(cpu_s: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU seconds per 1,000 tokens, by role (roles that used under a millisecond left out), plus "all"."""
    if tokens <= 0:
        return {}
    out = {role: 1000 * s / tokens for role, s in sorted(cpu_s.items(), key=lambda kv: -kv[1]) if s >= 0.001}
    out["all"] = 1000 * sum(cpu_s.values()) / tokens
    return out


def describe(per_1k: dict[str, float]) -> str:
    return ", ".join(f"{role} {v:.2f}" for role, v in per_1k.items())


@contextlib.contextmanager
def busy(n: int):
    """`n` processes spinning for the duration (`switchyard bench --busy N`): another program on the same cores,
    as a benchmark client is."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()
