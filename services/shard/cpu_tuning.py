"""A CPU shard's OpenMP team kept fitted to the free cores while it serves (the rule: libs/runtime/cpu_team.py).

At start it measures others' load over a short window and sets the team; then, between steps, it samples
/proc every few seconds and resizes the team (torch.set_num_threads) and its cores. It shrinks when two samples in
a row agree, so one burst of another process does not take a core from it, and grows on the first sample that shows
a core free again: a team too small costs every step until it grows, and a core taken back too soon only costs the
next two samples' wait.
"""

from __future__ import annotations

import time

import torch

from libs.runtime import cpu_team

SAMPLE_EVERY_S = 3.0  # then one /proc read every few seconds, between steps


class TeamTuner:
    def __init__(self, flags: cpu_team.CpuFlags, procs_shard: int, shard_index: int, log):
        self.flags, self.procs_shard, self.shard_index, self.log = flags, procs_shard, shard_index, log
        self.usable = cpu_team.usable_cpus()
        # a fixed team on fixed cores has nothing to measure
        self.adaptive = flags.threads is None or flags.bind == "auto"
        self.changes = 0  # resizes while serving, logged
        self.plan: cpu_team.TeamPlan | None = None
        self._pending: cpu_team.TeamPlan | None = None
        self._sampler = cpu_team.Sampler()
        self._next = 0.0

    def start(self) -> cpu_team.TeamPlan:
        others = None
        if self.adaptive:
            time.sleep(cpu_team.START_WINDOW_S)
            others = self._sampler.sample()
        self._apply(cpu_team.decide(self.usable, others, self.flags, self.procs_shard, self.shard_index), "start")
        self._next = time.monotonic() + SAMPLE_EVERY_S
        return self.plan

    def between_steps(self) -> None:
        """Cheap when not due: one clock read."""
        if not self.adaptive or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + SAMPLE_EVERY_S
        plan = cpu_team.decide(self.usable, self._sampler.sample(), self.flags, self.procs_shard, self.shard_index)
        if (plan.threads, plan.cpus) == (self.plan.threads, self.plan.cpus):
            self._pending = None
            return
        if plan.threads > self.plan.threads or (
            self._pending and (self._pending.threads, self._pending.cpus) == (plan.threads, plan.cpus)
        ):
            self.changes += 1
            self._apply(plan, "resized")
            self._pending = None
        else:
            self._pending = plan

    def _apply(self, plan: cpu_team.TeamPlan, when: str) -> None:
        torch.set_num_threads(plan.threads)
        cpu_team.pin_process(plan.cpus)
        self.plan = plan
        # torch.get_num_threads(): the team as torch holds it, which the tests read back
        self.log.info("cpu team %s: %d threads (torch.get_num_threads() = %d); %s", when, plan.threads,
                      torch.get_num_threads(), plan.reason)  # fmt: skip
