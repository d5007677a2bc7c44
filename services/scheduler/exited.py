"""`python -m services.scheduler.exited`: return once no scheduler runs in this process namespace.

A Kubernetes replica pod runs its scheduler and its shard as two containers sharing one process namespace, and on
termination both get SIGTERM at once. The shard's preStop hook runs this, so the shard keeps serving while its
scheduler drains (the requests it holds run to their end) and gets its SIGTERM only after the scheduler exited.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# a scheduler's argv after the pod's `exec python -m services.scheduler` (this module's own argv does not match)
SCHEDULER_ARGS = b"\0-m\0services.scheduler\0"
POLL_S = 0.5


def scheduler_running(proc: Path = Path("/proc")) -> bool:
    """Whether a process in `proc` runs `python -m services.scheduler`."""
    me = str(os.getpid())
    for entry in proc.iterdir():
        if not entry.name.isdigit() or entry.name == me:
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:  # it exited meanwhile, or is not ours to read
            continue
        if SCHEDULER_ARGS in b"\0" + argv:
            return True
    return False


def main() -> None:
    while scheduler_running():
        time.sleep(POLL_S)


if __name__ == "__main__":
    main()
