"""Bus addresses, all derived from one setting (`SWITCHYARD_BUS`).

- `ipc:///path/to/run-dir`: one socket file per address inside a private (0700) run directory,
  for everything on one host;
- `tcp://host:port`: the router's addresses on port, port+1, …, port+4 and replica r's on
  port+10+3r … port+12+3r, for services spread over hosts.

Only the router and the schedulers bind; everyone else connects.
"""

from __future__ import annotations

from dataclasses import dataclass

# sockaddr_un.sun_path holds 108 bytes; keep room for the longest socket name below
MAX_IPC_DIR = 80

_ROUTER_NAMES = ("intake", "tokenize", "admit", "events-in", "events-out")
_REPLICA_NAMES = ("in", "plan", "results")


@dataclass(frozen=True)
class Addresses:
    scheme: str  # "ipc" or "tcp"
    where: str  # run directory (ipc) or host (tcp)
    port: int = 0  # base port (tcp)

    @classmethod
    def parse(cls, spec: str) -> Addresses:
        if spec.startswith("ipc://"):
            path = spec[len("ipc://") :].rstrip("/")
            if not path.startswith("/"):
                raise ValueError(f"ipc bus needs an absolute run directory: {spec!r}")
            if len(path) > MAX_IPC_DIR:
                raise ValueError(f"run directory path too long for ipc sockets ({len(path)} > {MAX_IPC_DIR})")
            return cls("ipc", path)
        if spec.startswith("tcp://"):
            host, sep, port = spec[len("tcp://") :].rpartition(":")
            if not sep or not port.isdigit() or not host:
                raise ValueError(f"tcp bus needs host:port: {spec!r}")
            return cls("tcp", host.strip("[]"), int(port))
        raise ValueError(f"bus address must start with ipc:// or tcp://: {spec!r}")

    def _addr(self, name: str, offset: int) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.where}/{name}"
        host = f"[{self.where}]" if ":" in self.where else self.where
        return f"tcp://{host}:{self.port + offset}"

    def router(self, name: str) -> str:
        """One of the router's addresses: intake, tokenize, admit, events-in, events-out."""
        return self._addr(name, _ROUTER_NAMES.index(name))

    @property
    def intake(self) -> str:
        return self.router("intake")

    @property
    def tokenize(self) -> str:
        return self.router("tokenize")

    @property
    def admit(self) -> str:
        return self.router("admit")

    @property
    def events_in(self) -> str:
        return self.router("events-in")

    @property
    def events_out(self) -> str:
        return self.router("events-out")

    def replica(self, r: int, name: str) -> str:
        """Replica r's scheduler addresses: in, plan, results."""
        return self._addr(f"replica-{r}-{name}", 10 + 3 * r + _REPLICA_NAMES.index(name))
