"""Free tcp ports on 127.0.0.1 for the servers and ranks the tests start.

Under pytest-xdist each worker draws its ports from its own blocks of BLOCK ports (the block's number modulo the
workers), so two workers never pick the same port between the check here and the bind that follows. The ports lie
below the kernel's ephemeral range, so no process's outgoing connection takes one in that interval either (a
server then failed to bind a port of its range: "Address already in use").
"""

from __future__ import annotations

import os
import random
import socket

BLOCK = 32
LOWEST = 20000  # above the ports services commonly listen on
_draw = random.Random()  # its own generator: a test that seeds `random` does not make two draws alike


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux; 32768, its default, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _mine(port: int, n: int = 1) -> bool:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    return port // BLOCK % workers == worker and port % BLOCK + n <= BLOCK


def free_port() -> int:
    return free_port_range(1)


def free_port_range(n: int) -> int:
    """The first of n consecutive tcp ports free now (a tcp bus takes a run of ports)."""
    top = _ephemeral_low()
    if top - LOWEST < 4 * BLOCK:  # an unusual ephemeral range: draw from the ports above it (ephemeral, then)
        lowest, top = max(LOWEST, top), 65536
    else:
        lowest = LOWEST
    for _ in range(2000):
        base = _draw.randrange(lowest, top - n)
        if not _mine(base, n):
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
