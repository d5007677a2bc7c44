"""Several hosts on one machine, for the fault tests: network namespaces made by the test, joined by veth pairs on
one bridge, each with its loopback up. Nothing outside them is touched: the first namespace holds the bridge
(`10.213.0.1/24`), every other is a host on it (`10.213.0.2`, `.3`, …), and the test's own client threads enter a
namespace to reach its loopback. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); `Hosts.make` says why it cannot be
made. Everything is removed by `close()`, whatever state the test left."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

SUBNET = "10.213.0"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class Hosts:
    """Namespaces `<prefix>0` (the hub, with the bridge), `<prefix>1`, …; `address(i)` is host i's address."""

    def __init__(self, count: int):
        self.prefix = f"sy{os.getpid() % 100000}n"  # unique per test process; interface names stay under 15 bytes
        self.names = [f"{self.prefix}{i}" for i in range(count)]
        self.made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None: they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        try:
            subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as e:
            return f"no usable `ip netns`: {e}"
        return None

    def make(self) -> Hosts:
        hub = self.names[0]
        for name in self.names:
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{self.address(0)}/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names[1:], start=1):
            port, end = f"{self.prefix}p{i}", f"{self.prefix}e{i}"  # the hub's end on the bridge, the host's end
            _ip("link", "add", port, "netns", hub, "type", "veth", "peer", "name", end, "netns", name)
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", end)
            _ip("-n", name, "link", "set", end, "up")
        return self

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def command(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside host i's namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def enter(self, i: int) -> None:
        """Move the calling thread (only it) into host i's namespace: the sockets it opens from now on are there."""
        fd = os.open(f"/run/netns/{self.names[i]}", os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            os.close(fd)

    def close(self) -> None:
        """Kill what still runs in the namespaces (the test's own processes), then remove them, links and all."""
        for name in reversed(self.made):
            try:
                pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
                for pid in pids.stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except (OSError, subprocess.SubprocessError):
                pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        self.made.clear()

    def left(self) -> list[str]:
        """Namespaces of ours still present (none after close())."""
        present = Path("/run/netns")
        return [n for n in self.names if (present / n).exists()]
