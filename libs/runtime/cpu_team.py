"""The shard's OpenMP team on a CPU: how many threads, on which cores, and which cores the other processes get,
decided from what the machine is doing rather than from `os.cpu_count()` alone.

An OpenMP forward meets at a barrier tens of times per layer, so one team thread that the kernel preempts makes
the whole team wait: a core that another process keeps busy costs the team more than the core itself
(docs/benchmarks.md). So the team takes the cores that are free, not every core it may use:

- usable cores: `os.sched_getaffinity` (a container or `taskset` limit), shared by the host's shard processes;
- others' load: each core's busy share over a short window of /proc/stat, less what this process ran there
  (its threads' CPU time by the core they last ran on), so the shard's own spinning is not taken for contention;
- the team: the usable cores less the others' load counted in whole cores (at least one thread), placed on the
  least busy cores. A fraction of a core counts as a whole one from `--cpu-busy-share` on: a steady fraction of
  another process on a team thread's core costs the whole team that thread's share at every barrier. But the
  whole slice when no core is free (each busy), where a smaller team would only give up its per-thread share of
  the loaded cores;
- a kept core: with `--cpu-bind auto` a shard that owns 8 or more cores leaves one to the other processes (http,
  tokenizer, router, scheduler, detokenizer), as vLLM's `VLLM_CPU_NUM_OF_RESERVED_CPU` does; below that a kept
  core costs the forward more than the helpers' fraction of a core does. An explicit count overrides it;
- the wait policy: OpenMP's default (spin, then sleep) on free cores; PASSIVE when others already load the cores
  at start, so the team's idle threads yield the core instead of spinning against the other process.

`decide` is pure: it gets what was read and returns a `TeamPlan`. `Sampler` reads /proc; the shard keeps
sampling during serving and resizes its team between steps (`services/shard/cpu_tuning.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# a shard with at least this many cores keeps one for the other processes under --cpu-bind auto
KEEP_CORE_FROM = 8
# a core whose others' busy share is below this is free: a team moves onto free cores only
FREE_BELOW = 0.5
# others' load, in cores, at start from which the team's idle threads sleep instead of spinning
PASSIVE_FROM = 0.5
# the fraction of a core beyond whole cores from which others' load takes a core from the team (0.5: to the nearest)
BUSY_SHARE = 0.5
START_WINDOW_S = 0.3  # the measurement at start: long enough to see a busy core, short beside a model's load
THREADS_HELP = (
    "OpenMP threads of each CPU shard: a number, or auto (default: the usable cores free of other processes' "
    "load, measured at start and every few seconds while serving; env VLLM_CPU_OMP_THREADS_BIND's count is not read)"
)
BIND_HELP = (
    "cores of the CPU shard's threads: auto (default: the least busy usable cores, a core kept for the other "
    "processes when the shard has 8 or more), none (no pinning), or a list like 0-3,5 (env VLLM_CPU_OMP_THREADS_BIND, "
    "whose 'auto' and 'nobind' mean the same)"
)
BUSY_SHARE_HELP = (
    "the fraction of a core of other processes' load (beyond whole cores) from which the auto team gives up a "
    f"thread (default {BUSY_SHARE}; from 0.05 to 1; 0.5 rounds the load to the nearest core)"
)
RESERVED_HELP = (
    "cores kept for the other processes (http, tokenizer, router, scheduler, detokenizer), out of the shard's; "
    "auto (default: one when the shard has 8 or more cores) or a number (env VLLM_CPU_NUM_OF_RESERVED_CPU)"
)


@dataclass(frozen=True)
class CpuFlags:
    """--cpu-threads, --cpu-bind and --cpu-reserved, parsed: None means auto."""

    threads: int | None = None
    bind: tuple[int, ...] | str = "auto"  # "auto", "none", or the cores
    reserved: int | None = None
    busy_share: float = BUSY_SHARE  # --cpu-busy-share


@dataclass(frozen=True)
class TeamPlan:
    threads: int
    cpus: tuple[int, ...]  # the shard's affinity; () leaves it as it is
    helpers: tuple[int, ...]  # the other processes' affinity; () leaves theirs as it is
    wait_policy: str  # "" (OpenMP's default) or "PASSIVE"
    reason: str  # for the log line


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,5' → (0, 1, 2, 3, 5), sorted, each core once; ValueError saying what is wrong."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            raise ValueError(f"cpu list {text!r}: empty entry (write it like 0-3,5)")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu list {text!r}: {part!r} is not a core number or a range like 0-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu list {text!r}: range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def parse_flags(threads: str | int | None, bind: str | None, reserved: str | int | None,
                usable: tuple[int, ...], busy_share: str | float | None = None) -> CpuFlags:  # fmt: skip
    """The four flags (or their vLLM environment names) checked against the usable cores; ValueError with the
    flag's name and what is wrong."""
    t = None
    if threads not in (None, "", "auto"):
        try:
            t = int(threads)
        except ValueError:
            raise ValueError(f"--cpu-threads must be a number or auto, not {threads!r}") from None
        if t < 1:
            raise ValueError(f"--cpu-threads must be at least 1, not {t}")
        if t > len(usable):
            raise ValueError(f"--cpu-threads {t} is more than the {len(usable)} usable cores ({format_cpus(usable)})")
    b: tuple[int, ...] | str = "auto"
    if bind not in (None, "", "auto"):
        if bind in ("none", "nobind"):  # vLLM says nobind
            b = "none"
        else:
            b = parse_cpu_list(bind.replace("|", ","))  # vLLM separates ranks' lists with |; one shard here
            outside = sorted(set(b) - set(usable))
            if outside:
                raise ValueError(
                    f"--cpu-bind {bind}: cores {format_cpus(tuple(outside))} are not usable by this process "
                    f"(usable: {format_cpus(usable)})"
                )
            if t is not None and t > len(b):
                raise ValueError(f"--cpu-threads {t} is more than the {len(b)} cores of --cpu-bind {bind}")
    r = None
    if reserved not in (None, "", "auto"):
        try:
            r = int(reserved)
        except ValueError:
            raise ValueError(f"--cpu-reserved must be a number or auto, not {reserved!r}") from None
        if not 0 <= r < len(usable):
            raise ValueError(
                f"--cpu-reserved must be from 0 to {len(usable) - 1} (usable cores: {len(usable)}), not {r}"
            )
    share = BUSY_SHARE
    if busy_share not in (None, ""):
        try:
            share = float(busy_share)
        except ValueError:
            raise ValueError(f"--cpu-busy-share must be a number from 0.05 to 1, not {busy_share!r}") from None
        if not 0.05 <= share <= 1:
            raise ValueError(f"--cpu-busy-share must be from 0.05 to 1 (a fraction of a core), not {share}")
    return CpuFlags(threads=t, bind=b, reserved=r, busy_share=share)


def cores_taken(load: float, busy_share: float = BUSY_SHARE) -> int:
    """Others' load in cores, counted in whole cores: a fraction counts once it reaches `busy_share`."""
    return int(load + 1 - busy_share + 1e-9)


def format_cpus(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 5) → '0-3,5'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def split(usable: tuple[int, ...], flags: CpuFlags, procs_shard: int = 1, shard_index: int = 0):
    """(this shard's cores, the other processes' cores): a load-free decision, so every process of a server
    computes the same split from the flags alone. The host's shards share the cores in equal slices; kept cores
    come off the end."""
    if flags.bind == "none":
        return usable, ()
    pool = flags.bind if isinstance(flags.bind, tuple) else usable
    keep = flags.reserved
    if keep is None:
        keep = 1 if isinstance(flags.bind, str) and len(pool) // max(1, procs_shard) >= KEEP_CORE_FROM else 0
    if isinstance(flags.bind, tuple):  # an explicit list: the others get what the list leaves, if anything
        rest = tuple(c for c in usable if c not in pool)
        helpers = rest or (pool[-keep:] if keep else ())
        pool = pool[:-keep] if keep and not rest else pool
    else:
        helpers = pool[len(pool) - keep :] if keep else ()
        pool = pool[: len(pool) - keep]
    n = max(1, procs_shard)
    per = max(1, len(pool) // n)
    mine = pool[(shard_index % n) * per : (shard_index % n) * per + per] or pool[-per:]
    return mine, helpers


def decide(usable: tuple[int, ...], others: dict[int, float] | None, flags: CpuFlags, procs_shard: int = 1,
           shard_index: int = 0) -> TeamPlan:  # fmt: skip
    """The team for what was read: `usable` cores, `others` = each core's busy share (0..1) by other processes
    over the last window (None: not measured)."""
    mine, helpers = split(usable, flags, procs_shard, shard_index)
    others = others or {}
    load = sum(min(1.0, max(0.0, others.get(c, 0.0))) for c in mine)
    if flags.threads is not None:
        threads, why = min(flags.threads, len(mine)) if flags.bind != "none" else flags.threads, "--cpu-threads"
    else:
        threads = max(1, min(len(mine), len(mine) - cores_taken(load, flags.busy_share)))
        why = f"{len(mine)} cores, others' load {load:.2f} cores"
        if others and not any(others.get(c, 0.0) < FREE_BELOW for c in mine):
            # no core free to move onto: the kernel shares loaded cores per thread, so a smaller team would only
            # give up its share (measured served on an oversubscribed host: docs/benchmarks.md)
            threads, why = len(mine), f"{why}, none free"
    wait = "PASSIVE" if load >= PASSIVE_FROM else ""
    if flags.bind == "none":
        return TeamPlan(threads, (), (), wait, f"{why}; unpinned (--cpu-bind none)")
    # the least busy cores (ties: in order), so the team and the other processes meet on as few cores as can be
    cpus = tuple(sorted(sorted(mine, key=lambda c: others.get(c, 0.0))[:threads]))
    where = f"on cores {format_cpus(cpus)}" + (f", others on {format_cpus(helpers)}" if helpers else "")
    return TeamPlan(threads, cpus, helpers, wait, f"{why}; {where}")


# /proc/stat's columns after the name: user nice system idle iowait irq softirq steal (guest is within user)
_IDLE_COLUMNS = (3, 4)


def read_proc_stat(text: str | None = None) -> dict[int, tuple[int, int]]:
    """Each core's (busy ticks, total ticks) since boot. Steal counts as busy: a hypervisor's other guests take
    the core as surely as a process does."""
    text = Path("/proc/stat").read_text() if text is None else text
    out = {}
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *cols = line.split()
            ticks = [int(v) for v in cols[:8]]
            idle = sum(ticks[i] for i in _IDLE_COLUMNS)
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def read_own_ticks(pid: int | None = None) -> dict[int, int]:
    """This process's CPU ticks (user + system) per core, each thread counted on the core it last ran on."""
    pid = os.getpid() if pid is None else pid
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        cpu = int(fields[36])  # processor (field 39)
        out[cpu] = out.get(cpu, 0) + ticks
    return out


def others_load(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], own_before: dict[int, int],
                own_after: dict[int, int]) -> dict[int, float]:  # fmt: skip
    """Each core's busy share over the window less this process's share there, clamped to 0..1."""
    out = {}
    own_total = {c: own_after.get(c, 0) - own_before.get(c, 0) for c in own_after}
    for c, (busy, total) in after.items():
        if c not in before:
            continue
        d_total = total - before[c][1]
        if d_total <= 0:
            out[c] = 0.0
            continue
        busy_share = (busy - before[c][0]) / d_total
        own_share = max(0, own_total.get(c, 0)) / d_total
        out[c] = min(1.0, max(0.0, busy_share - own_share))
    return out


class Sampler:
    """Others' load per core between two reads of /proc (a few hundred microseconds each, no waiting)."""

    def __init__(self):
        self._last = self._read()

    @staticmethod
    def _read():
        try:
            return read_proc_stat(), read_own_ticks()
        except OSError:  # no /proc (not Linux): no measurement, the decision takes the cores as free
            return {}, {}

    def sample(self) -> dict[int, float]:
        now = self._read()
        (stat0, own0), (stat1, own1) = self._last, now
        self._last = now
        return others_load(stat0, stat1, own0, own1)


def usable_cpus() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform: every core the OS counts
        return tuple(range(os.cpu_count() or 1))


def pin_process(cpus: tuple[int, ...], pid: int | None = None) -> None:
    """Every thread of a process (and the threads it starts later) on `cpus`. os.sched_setaffinity on a thread
    id moves that thread only, and OpenMP's threads already exist, so each task is moved."""
    pid = os.getpid() if pid is None else pid
    if not cpus:
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended meanwhile
            pass


def flags_from(settings) -> CpuFlags:
    """A Settings' cpu_* fields (checked by the launcher; a process started by hand gets the same check).
    SWITCHYARD_TORCH_THREADS, the older switch, still fixes the team's size when --cpu-threads is auto."""
    threads = settings.cpu_threads
    if threads in ("", "auto") and settings.torch_threads:
        threads = settings.torch_threads
    return parse_flags(threads, settings.cpu_bind, settings.cpu_reserved, usable_cpus(), settings.cpu_busy_share)


def pin_helper(settings, log) -> None:
    """A process other than a shard: onto the kept cores, where the flags keep some."""
    _, helpers = split(usable_cpus(), flags_from(settings), max(1, settings.procs_shard))
    if helpers:
        pin_process(helpers)
        log.info("on cores %s, kept for the processes beside the shards", format_cpus(helpers))
