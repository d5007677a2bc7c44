"""tests/ports.py: each pytest-xdist worker draws its ports from its own blocks, a range stays in one block, and
ranges lie below the kernel's ephemeral ports (which outgoing connections take)."""

import socket

from tests.ports import BLOCK, LOWEST, _ephemeral_low, free_port_range


def test_workers_draw_from_their_own_blocks(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for worker in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        for _ in range(20):
            base = free_port_range(6)
            assert base // BLOCK % 3 == worker and base % BLOCK + 6 <= BLOCK
            if _ephemeral_low() - LOWEST >= 4 * BLOCK:  # the usual ephemeral range (Linux: 32768 up)
                assert LOWEST <= base and base + 6 <= _ephemeral_low()
            for port in range(base, base + 6):  # free when drawn
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
