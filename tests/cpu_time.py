"""Where the test suite's CPU goes: a pytest plugin that writes each test's wall time and CPU time (pytest's own
process, and the processes it started and reaped: the servers), and a table of the files that cost the most.

    .venv/bin/python -m pytest -p tests.cpu_time -n 2 --dist loadfile --ignore=tests/bench   # writes .cpu_time/
    .venv/bin/python -m tests.cpu_time                                                         # the table

A server is counted when its launcher is reaped, so a session fixture's lands on its worker's last test.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT = Path(".cpu_time")
_sink = None


def _cpu() -> tuple[float, float]:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _sink
    if _sink is None:
        OUT.mkdir(exist_ok=True)
        _sink = open(OUT / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "w")
    started, (own, reaped) = time.monotonic(), _cpu()
    yield
    own_after, reaped_after = _cpu()
    wall = time.monotonic() - started
    row = {"test": item.nodeid, "wall": wall, "own": own_after - own, "reaped": reaped_after - reaped}
    _sink.write(json.dumps(row) + "\n")
    _sink.flush()


def table(folder: Path = OUT, most: int = 30) -> str:
    wall, own, reaped = defaultdict(float), defaultdict(float), defaultdict(float)
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            name = row["test"].split("::")[0]
            wall[name] += row["wall"]
            own[name] += row["own"]
            reaped[name] += row["reaped"]
    files = sorted(wall, key=lambda f: -(own[f] + reaped[f]))
    lines = [f"{'wall s':>8} {'CPU s':>8} {'of it, children':>15}  file"]
    for f in files[:most]:
        lines.append(f"{wall[f]:8.0f} {own[f] + reaped[f]:8.0f} {reaped[f]:15.0f}  {f}")
    total = sum(own.values()) + sum(reaped.values())
    lines.append(f"{sum(wall.values()):8.0f} {total:8.0f} {sum(reaped.values()):15.0f}  all {len(files)} files")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
