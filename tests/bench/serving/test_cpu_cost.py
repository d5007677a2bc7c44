"""CPU seconds per 1,000 tokens by process (bench/serving/cpu_cost.py), read from a real process tree."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.serving import cpu_cost

SPIN = "import sys, time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass\nsys.stdin.read()"


def test_a_busy_child_shows_its_cpu_per_1k_tokens():
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE)
    try:
        cpu = cpu_cost.ProcessCpu(child.pid)
        cpu.start()
        while True:  # until it has burnt its 0.2 s of CPU
            used = cpu_cost.cpu_and_switches(child.pid)[0]
            if used >= 0.2:
                break
            time.sleep(0.01)
        got = cpu.stop()
    finally:
        child.communicate(b"")
    assert len(got) == 1  # one process, named by its executable
    per = cpu_cost.per_1k_tokens(got, 500)
    (role,) = set(per) - {"all"}
    assert per["all"] == per[role] and 0.0 < per[role] <= 2 * 0.2 * 1000 / 500 + 0.2
    assert cpu_cost.per_1k_tokens(got, 0) == {}
