"""Run directories: where a local server keeps its bus sockets, and how to tell a live one from a stale one.

`switchyard serve` makes a private directory `switchyard-*` under the run root ($SWITCHYARD_RUN_ROOT, default
/tmp: ipc socket paths are limited to ~100 bytes). The launcher holds an exclusive flock on its `lock` file, and
so does supervisord, which inherits the descriptor: a kernel releases a flock when its last holder dies, SIGKILL
included, so a free lock proves the server dead and a held one alive. The lock file appears already locked
(locked under another name, then renamed), so a directory being created never looks dead. A directory without
a lock file counts as dead only if its supervisord socket refuses connections. docs/deployment.md tells why.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from libs.runtime.settings import env_name, env_value

ROOT_VAR = env_name("run_root")
PREFIX = "switchyard-"
LOCK = "lock"

LIVE, DEAD, UNKNOWN = "live", "dead", "unknown"
log = logging.getLogger("switchyard.launcher")


def root() -> Path:
    return Path(env_value("run_root") or "/tmp")


def create(where: Path | None = None) -> tuple[Path, int]:
    """A new private (0700) run directory and the descriptor of its held lock (keep it open while serving)."""
    run_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=where or root()))
    fd = os.open(run_dir / (LOCK + ".new"), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(run_dir / (LOCK + ".new"), run_dir / LOCK)  # only now does the directory look like a server's
    return run_dir, fd


def _lock_free(path: Path, mode: int) -> int | None:
    """An open descriptor holding `mode` on the lock at path if nobody else holds it, else None (held)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise


def _socket_refuses(path: Path) -> bool:
    """True if a unix socket file exists at path and nothing accepts on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def _ours(d: Path) -> bool:
    try:
        st = d.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()  # no symlinks, no other user's directories


def state(d: Path) -> str:
    """LIVE, DEAD (provably: its lock is free, or its supervisord socket refuses), or UNKNOWN."""
    try:
        fd = _lock_free(d / LOCK, fcntl.LOCK_SH)
    except FileNotFoundError:
        sock = d / "supervisor.sock"
        try:
            return DEAD if stat.S_ISSOCK(sock.lstat().st_mode) and _socket_refuses(sock) else UNKNOWN
        except OSError:
            return UNKNOWN
    except OSError:
        return UNKNOWN
    if fd is None:
        return LIVE
    os.close(fd)
    return DEAD


def scan(where: Path | None = None) -> dict[Path, str]:
    """This user's run directories under the run root, each with its state."""
    base = where or root()
    try:
        found = sorted(p for p in base.glob(PREFIX + "*") if _ours(p))
    except OSError:
        return {}
    return {d: state(d) for d in found}


def live(where: Path | None = None) -> list[Path]:
    return [d for d, s in scan(where).items() if s == LIVE]


def remove_stale(where: Path | None = None) -> list[Path]:
    """Remove the run directories of servers that are provably dead; never a live or an undecided one."""
    removed = []
    for d in sorted((where or root()).glob(PREFIX + "*")):
        if not _ours(d):
            continue
        try:
            fd = _lock_free(d / LOCK, fcntl.LOCK_EX)  # held while removing: a prober sees it as busy, not gone
        except FileNotFoundError:
            fd = -1 if state(d) == DEAD else None
        except OSError:
            continue
        if fd is None:
            continue
        try:
            shutil.rmtree(d)
            removed.append(d)
        except OSError as e:
            log.warning("could not remove the stale run directory %s: %s", d, e)
        finally:
            if fd >= 0:
                os.close(fd)
    return removed
