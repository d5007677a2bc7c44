"""Bus addresses, all derived from one setting (`SWITCHYARD_BUS`).

- `ipc:///path/to/run-dir`: one socket file per address inside a private (0700) run directory, for one host;
- `tcp://host:port`: the router's addresses on port … port+4 and replica r's on port+10+3r … port+12+3r;
- `tcp://host:port?replicas=host2:port2`: the schedulers elsewhere, replica r's on host2 at port2+3r … port2+3r+2;
  or `?replicas=h0:p0,h1:p1,…`, one host:port per replica (in, plan and results on p, p+1, p+2).

Only the router and the schedulers bind; everyone else connects. A binding process names an address of its own
host (an IP of one of its interfaces, 0.0.0.0 for all of them, or a name that resolves to one: ZeroMQ resolves
names on bind too), so on a multi-host deployment each process's spec may differ (docs/deployment.md).
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
    # where the replicas' schedulers are, when not on `where`: (host, port) per replica, or one
    # (host, base port) for all of them (replica r on base + 3r)
    replica_hosts: tuple[tuple[str, int], ...] = ()

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
            main, _, query = spec[len("tcp://") :].partition("?")
            host, port = _host_port(main, spec)
            replicas: tuple[tuple[str, int], ...] = ()
            if query:
                key, eq, value = query.partition("=")
                if key != "replicas" or not eq or not value:
                    raise ValueError(f"tcp bus: the only option is ?replicas=host:port[,host:port…]: {spec!r}")
                replicas = tuple(_host_port(item, spec) for item in value.split(","))
            return cls("tcp", host, port, replicas)
        raise ValueError(f"bus address must start with ipc:// or tcp://: {spec!r}")

    def _addr(self, name: str, offset: int, where: tuple[str, int] | None = None) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.where}/{name}"
        host, port = where or (self.where, self.port)
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{port + offset}"

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
        offset = _REPLICA_NAMES.index(name)
        if len(self.replica_hosts) == 1:  # one base for all replicas
            return self._addr("", 3 * r + offset, self.replica_hosts[0])
        if self.replica_hosts:
            if r >= len(self.replica_hosts):
                raise ValueError(f"replica {r}: the bus names only {len(self.replica_hosts)} replica addresses")
            return self._addr("", offset, self.replica_hosts[r])
        return self._addr(f"replica-{r}-{name}", 10 + 3 * r + offset)


def _host_port(text: str, spec: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host.strip("[]"):
        raise ValueError(f"tcp bus needs host:port: {spec!r}")
    return host.strip("[]"), int(port)
