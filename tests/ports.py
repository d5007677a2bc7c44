"""Free tcp ports on 127.0.0.1 for the servers and ranks the tests start.

Under pytest-xdist each worker draws its ports from its own blocks of BLOCK ports (the block's number modulo the
workers), so two workers never pick the same port between the check here and the bind that follows.
"""

from __future__ import annotations

import os
import socket

BLOCK = 32


def _mine(port: int, n: int = 1) -> bool:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    return port // BLOCK % workers == worker and port % BLOCK + n <= BLOCK


def free_port() -> int:
    return free_port_range(1)


def free_port_range(n: int) -> int:
    """The first of n consecutive tcp ports free now (a tcp bus takes a run of ports)."""
    for _ in range(2000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535 or not _mine(base, n):
            continue
        socks = []
        try:
            for p in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")
