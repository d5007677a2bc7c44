"""The OpenMP team's decision as a function of what it reads (usable cores, others' load, flags), the flags'
errors, and the /proc readings it decides from."""

from __future__ import annotations

import os

import pytest

from libs.runtime import cpu_team
from libs.runtime.cpu_team import CpuFlags, decide, parse_cpu_list, parse_flags

AUTO = CpuFlags()


def test_cpu_lists_parse_and_format():
    assert parse_cpu_list("0-3,5") == (0, 1, 2, 3, 5)
    assert parse_cpu_list("5,1,1-2") == (1, 2, 5)
    assert cpu_team.format_cpus((0, 1, 2, 3, 5, 7, 8)) == "0-3,5,7-8"
    for bad, why in [("0-", "not a core number"), ("a", "not a core number"), ("3-1", "backwards"), ("1,,2", "empty")]:
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad)


def test_free_cores_get_every_thread_and_the_default_wait_policy():
    plan = decide((0, 1), {0: 0.05, 1: 0.1}, AUTO)
    assert (plan.threads, plan.cpus, plan.helpers, plan.wait_policy) == (2, (0, 1), (), "")
    assert decide((0, 1), None, AUTO).threads == 2  # not measured: the cores count as free


def test_a_busy_core_leaves_the_team_and_the_team_takes_the_free_one():
    # another process keeps core 0 busy: one thread, on core 1, and idle threads sleep rather than spin
    plan = decide((0, 1), {0: 0.95, 1: 0.02}, AUTO)
    assert (plan.threads, plan.cpus, plan.wait_policy) == (1, (1,), "PASSIVE")
    # a core's worth of load, most of it on one core: one thread, on the freer core
    assert decide((0, 1), {0: 0.7, 1: 0.3}, AUTO).cpus == (1,)
    # the helpers' usual fraction of a core does not cost a thread
    assert decide((0, 1), {0: 0.2, 1: 0.15}, AUTO).threads == 2
    # four cores all loaded: the whole team (below); three loaded and one free: one thread, on the free one
    assert decide((0, 1, 2, 3), {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.9}, AUTO).threads == 4
    assert decide((0, 1, 2, 3), {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.1}, AUTO).cpus == (3,)


def test_the_busy_share_decides_when_a_fraction_of_a_core_takes_a_thread():
    """--cpu-busy-share: a steady fraction of another process's core counts as a whole core from that share on."""
    flood = {0: 0.17, 1: 0.15}  # a third of a core of other processes, spread over both cores
    assert decide((0, 1), flood, CpuFlags(busy_share=0.5)).threads == 2  # rounded to the nearest core: none
    plan = decide((0, 1), flood, CpuFlags(busy_share=0.25))
    assert (plan.threads, plan.cpus) == (1, (1,))  # a core taken: one thread, on the freer core
    assert decide((0, 1), {0: 0.1, 1: 0.1}, CpuFlags(busy_share=0.25)).threads == 2  # below the share
    assert decide((0, 1, 2, 3), {0: 0.7, 1: 0.6, 2: 0.0, 3: 0.0}, CpuFlags(busy_share=0.25)).threads == 2
    assert decide((0, 1, 2, 3), {0: 0.6, 1: 0.6, 2: 0.0, 3: 0.0}, CpuFlags(busy_share=0.5)).threads == 3
    # the count itself: whole cores, plus one once the fraction reaches the share
    assert [cpu_team.cores_taken(x, 0.25) for x in (0.0, 0.24, 0.25, 1.0, 1.3)] == [0, 0, 1, 1, 2]
    assert [cpu_team.cores_taken(x, 0.5) for x in (0.49, 0.5, 1.49, 1.5)] == [0, 1, 1, 2]
    assert decide((0, 1), flood, CpuFlags(threads=2, busy_share=0.25)).threads == 2  # a fixed team stays fixed


def test_no_free_core_keeps_the_whole_team():
    """Every core loaded (an oversubscribed host): no core to move onto, and the kernel shares the loaded cores
    per thread, so the team keeps one thread per core (unpinned share), idle threads sleeping."""
    plan = decide((0, 1), {0: 1.0, 1: 1.0}, AUTO)
    assert (plan.threads, plan.cpus, plan.wait_policy) == (2, (0, 1), "PASSIVE") and "none free" in plan.reason
    assert decide((0, 1), {0: 0.5, 1: 0.5}, AUTO).threads == 2


def test_a_core_is_kept_for_the_other_processes_on_large_machines_only():
    eight = tuple(range(8))
    plan = decide(eight, {}, AUTO)
    assert (plan.threads, plan.cpus, plan.helpers) == (7, tuple(range(7)), (7,))
    assert decide(tuple(range(4)), {}, AUTO).helpers == ()
    # an explicit count overrides the rule, both ways
    plan = decide(tuple(range(4)), {}, CpuFlags(reserved=1))
    assert (plan.threads, plan.cpus, plan.helpers) == (3, (0, 1, 2), (3,))
    assert decide(eight, {}, CpuFlags(reserved=0)).helpers == ()


def test_explicit_flags_fix_the_team():
    plan = decide((0, 1, 2, 3), {0: 1.0, 1: 1.0}, CpuFlags(threads=2))
    assert plan.threads == 2 and plan.reason.startswith("--cpu-threads")
    plan = decide((0, 1, 2, 3), {}, CpuFlags(bind=(1, 3)))
    assert (plan.threads, plan.cpus, plan.helpers) == (2, (1, 3), (0, 2))  # the others get what the list leaves
    plan = decide((0, 1), {0: 1.0}, CpuFlags(threads=2, bind="none"))
    assert (plan.threads, plan.cpus, plan.helpers) == (2, (), ())  # the old fixed team: all cores, unpinned


def test_the_host_shards_share_the_cores_in_slices():
    usable = tuple(range(4))
    a = decide(usable, {}, AUTO, procs_shard=2, shard_index=0)
    b = decide(usable, {}, AUTO, procs_shard=2, shard_index=1)
    assert (a.cpus, b.cpus) == ((0, 1), (2, 3))
    # a busy core in the second slice costs the second shard only
    assert decide(usable, {3: 1.0}, AUTO, procs_shard=2, shard_index=1).cpus == (2,)


def test_flag_errors_say_what_is_wrong():
    usable = (0, 1)
    assert parse_flags("auto", "auto", "auto", usable) == AUTO
    assert parse_flags("2", "0-1", "0", usable) == CpuFlags(threads=2, bind=(0, 1), reserved=0)
    assert parse_flags(None, "nobind", None, usable).bind == "none"  # vLLM's word
    cases = [
        (("0", None, None), "--cpu-threads must be at least 1"),
        (("two", None, None), "--cpu-threads must be a number or auto"),
        (("3", None, None), "more than the 2 usable cores"),
        ((None, "0-3", None), "cores 2-3 are not usable"),
        ((None, "1-", None), "not a core number"),
        (("2", "1", None), "more than the 1 cores of --cpu-bind"),
        ((None, None, "2"), "--cpu-reserved must be from 0 to 1"),
        ((None, None, "x"), "--cpu-reserved must be a number or auto"),
    ]
    for args, why in cases:
        with pytest.raises(ValueError, match=why):
            parse_flags(*args, usable)
    assert parse_flags(None, None, None, usable, "0.3").busy_share == 0.3
    assert parse_flags(None, None, None, usable, "").busy_share == cpu_team.BUSY_SHARE
    for share, why in (("0", "from 0.05 to 1"), ("1.5", "from 0.05 to 1"), ("half", "a number")):
        with pytest.raises(ValueError, match=f"--cpu-busy-share must be {why}"):
            parse_flags(None, None, None, usable, share)


STAT = """cpu  300 0 100 1600 0 0 0 0 0 0
cpu0 100 0 50 850 0 0 0 0 0 0
cpu1 200 0 50 750 0 0 0 0 0 0
intr 1 2 3
"""
STAT_LATER = """cpu  500 0 100 1600 0 0 0 0 0 0
cpu0 100 0 50 950 0 0 0 0 0 0
cpu1 270 0 60 770 0 10 0 10 0 0
"""


def test_others_load_is_the_busy_share_less_this_process():
    before, after = cpu_team.read_proc_stat(STAT), cpu_team.read_proc_stat(STAT_LATER)
    assert before == {0: (150, 1000), 1: (250, 1000)}
    # core 1: 100 ticks, 90 busy (user, system, irq, steal); 40 of them this process's
    load = cpu_team.others_load(before, after, {1: 500}, {1: 540})
    assert load[0] == 0.0 and load[1] == pytest.approx(0.5)


def test_the_sampler_sees_a_busy_process():
    """Real /proc: a child spinning on core 0 shows as others' load there."""
    usable = cpu_team.usable_cpus()
    if 0 not in usable:
        pytest.skip("core 0 is not usable here")
    pid = os.fork()
    if pid == 0:  # the busy process, on core 0 only
        os.sched_setaffinity(0, {0})
        while True:
            pass
    try:
        sampler = cpu_team.Sampler()
        loads = []
        for _ in range(3):
            x = 0
            for i in range(2_000_000):  # this process busy meanwhile (a window of ~0.1 s)
                x += i
            loads.append(sampler.sample().get(0, 0.0))
        assert max(loads) > 0.5, loads
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_pin_process_moves_every_thread():
    import threading

    usable = cpu_team.usable_cpus()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        cpu_team.pin_process(usable[:1])
        tids = [int(x) for x in os.listdir(f"/proc/{os.getpid()}/task")]
        assert all(os.sched_getaffinity(tid) == {usable[0]} for tid in tids)
    finally:
        cpu_team.pin_process(usable)
        stop.set()
        t.join()
    assert os.sched_getaffinity(0) == set(usable)
