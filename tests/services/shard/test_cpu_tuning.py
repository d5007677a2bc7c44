"""The shard's team while it serves (services/shard/cpu_tuning.py): a process that starts spinning on a core
shrinks the team between steps, on real /proc readings, and torch's thread count follows."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from libs.runtime import cpu_team
from services.shard import cpu_tuning


def test_a_busy_core_shrinks_the_team_between_steps(monkeypatch, caplog):
    usable = cpu_team.usable_cpus()
    if len(usable) < 2:
        pytest.skip("needs two usable cores")
    monkeypatch.setattr(cpu_tuning, "SAMPLE_EVERY_S", 0.2)  # a sample per call below, not one every 3 s
    threads_before = torch.get_num_threads()
    tuner = cpu_tuning.TeamTuner(cpu_team.CpuFlags(), 1, 0, logging.getLogger("test.cpu_tuning"))
    pid = os.fork()
    if pid == 0:  # the other process: busy on the first usable core
        os.sched_setaffinity(0, {usable[0]})
        while True:
            pass
    try:
        with caplog.at_level(logging.INFO, "test.cpu_tuning"):
            start = tuner.start()
            deadline = time.monotonic() + 30
            while tuner.plan.threads != 1:
                assert time.monotonic() < deadline, tuner.plan
                time.sleep(0.05)  # a step's time
                tuner.between_steps()
        # (which core it keeps depends on what else runs on this host: the busy one is avoided when the other is free)
        assert torch.get_num_threads() == 1 and len(tuner.plan.cpus) == 1, tuner.plan
        assert os.sched_getaffinity(0) == set(tuner.plan.cpus)
        if start.threads > 1:  # the host was free at start: the resize happened while serving, and was logged
            assert tuner.changes >= 1 and "cpu team resized: 1 threads" in caplog.text
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        cpu_team.pin_process(usable)
        torch.set_num_threads(threads_before)
