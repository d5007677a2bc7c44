"""The shard's team while it serves (services/shard/cpu_tuning.py): readings that show a core gone busy shrink the
team between steps once two samples agree, torch's thread count and the affinity follow, and a free core again
grows it back on the first sample that shows it. The readings are given (the /proc reading itself:
tests/libs/runtime/test_cpu_team.py), so what the host's other jobs do cannot change the outcome."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from libs.runtime import cpu_team
from services.shard import cpu_tuning


class Readings:
    """Others' load per core, as Sampler.sample returns it, set by the test."""

    def __init__(self, load: dict[int, float]):
        self.load = load

    def sample(self) -> dict[int, float]:
        return dict(self.load)


def test_the_team_follows_the_readings_between_steps(monkeypatch, caplog):
    usable = cpu_team.usable_cpus()
    if len(usable) < 2:
        pytest.skip("needs two usable cores")
    a, b = usable[0], usable[1]
    monkeypatch.setattr(cpu_tuning, "SAMPLE_EVERY_S", 0.0)  # a sample at every step
    monkeypatch.setattr(cpu_team, "START_WINDOW_S", 0.0)
    threads_before = torch.get_num_threads()
    tuner = cpu_tuning.TeamTuner(cpu_team.CpuFlags(), 1, 0, logging.getLogger("test.cpu_tuning"))
    readings = tuner._sampler = Readings({c: 0.0 for c in usable})
    try:
        with caplog.at_level(logging.INFO, "test.cpu_tuning"):
            assert tuner.start().threads == len(usable) and torch.get_num_threads() == len(usable)
            readings.load = {**{c: 1.0 for c in usable}, b: 0.0}  # every core busy but b
            tuner.between_steps()
            assert tuner.plan.threads == len(usable)  # one sample: not yet (a burst does not resize)
            tuner.between_steps()
            assert tuner.plan.cpus == (b,) and torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {b}
            assert tuner.changes == 1 and "cpu team resized: 1 threads (torch.get_num_threads() = 1)" in caplog.text
            readings.load = {c: 0.0 for c in usable}  # the other process ended
            tuner.between_steps()  # one sample grows it back
            assert torch.get_num_threads() == len(usable) and os.sched_getaffinity(0) == set(usable)
            assert tuner.changes == 2 and a in tuner.plan.cpus
    finally:
        cpu_team.pin_process(usable)
        torch.set_num_threads(threads_before)
