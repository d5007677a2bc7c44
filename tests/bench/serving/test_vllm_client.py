"""`switchyard bench --client vllm` (bench/serving/vllm_client.py): the recipe's command, the CPU read of a process
with its ended threads, and, where vLLM's client is installed (`make peers`), one real level against Switchyard."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import pytest

from bench.serving import servers, vllm_client


def _args(**kw) -> argparse.Namespace:
    base = dict(prompt_tokens=32, output_tokens=8, concurrency="2", waves=1, dtype="float32", serve_flag=[], peers="")
    return argparse.Namespace(**{**base, **kw})


def test_the_command_is_the_recipes():
    cmd = vllm_client.client_command("http://127.0.0.1:9", "m", Path("/t"), _args(), 16, 96, Path("/r/x.json"))
    # each flag with the word after it (a flag without a value maps to the next flag)
    flags = {a: b for a, b in zip(cmd[3:], cmd[4:], strict=False) if a.startswith("--")}
    assert cmd[1] == "-c" and "vllm.benchmarks.serve" in cmd[2]
    assert flags["--random-input-len"] == "32" and flags["--random-output-len"] == "8"
    assert flags["--num-prompts"] == "96" and flags["--max-concurrency"] == "16"
    assert "--ignore-eos" in cmd and flags["--result-filename"] == "x.json" and flags["--result-dir"] == "/r"


def test_process_cpu_keeps_the_time_of_ended_threads():
    before = vllm_client._process_cpu(os.getpid())

    def spin():
        end = os.times().user + 0.1
        while os.times().user < end:
            pass

    t = threading.Thread(target=spin)
    t.start()
    t.join()  # the thread has ended: /proc/PID/task no longer lists it
    assert vllm_client._process_cpu(os.getpid()) - before >= 0.08


@pytest.mark.skipif(servers.vllm_status() is not None, reason="vLLM's client is not installed (make peers)")
def test_one_level_against_switchyard(tmp_path):
    from bench import models

    _, view = models.resolve("tiny")
    with servers.switchyard(view, tmp_path / "s.log", "--dtype", "float32") as srv:
        srv.wait_healthy(300)
        row = vllm_client.drive(srv, str(view), view, _args(), 2, 4, tmp_path / "r.json", steps=True)
    # the client counts output tokens by re-tokenizing the text it got: near, not always equal to, 4 × 8
    assert row["completed"] == 4 and row["failed"] == 0 and row["total_output_tokens"] >= 4 * 8 - 4
    assert row["cpu_s_per_1k_tokens"]["all"] > 0  # the server's processes were measured over the timed part
    assert row["client_cpu_s_per_1k_tokens"] is not None
    assert row["steps"] >= 8 and row["step"]["shard_forward_ms"] > 0  # the step's parts, from /metrics
    assert "switchyard" in vllm_client.table([{**row, "engine": "switchyard", "concurrency": 2}])
