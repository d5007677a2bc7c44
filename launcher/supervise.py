"""Run supervisord in the foreground: forward Ctrl-C/SIGTERM, give up on a program that cannot start,
say when the server is ready, and make the server's lifetime the launcher's.

A program that keeps dying at start ends FATAL in supervisord: we ask over its socket every POLL_S and then stop
the whole server with a non-zero exit, as TGI's launcher does; a shard whose model does not load (the run
directory's `cannot-load` file) stops a starting server at once. supervisord runs in its own session (Ctrl-C
reaches only us, and we stop it), and on Linux with the parent-death signal set to SIGTERM, so it stops every
program when the launcher dies by any signal, SIGKILL included; elsewhere we warn at start. docs/deployment.md
tells why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

log = logging.getLogger("switchyard.launcher")
POLL_S = 2.0
DRAIN_MARGIN_S = 5.0  # beyond the graceful termination timeout: http's last error events, the exits
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def fatal_programs(socket_path: Path) -> list[str]:
    """Programs (process groups) supervisord gave up on, once each; [] while it is not answering yet."""
    transport = SupervisorTransport(None, None, f"unix://{socket_path}")
    try:
        rpc = xmlrpc.client.ServerProxy("http://localhost", transport=transport)
        infos = rpc.supervisor.getAllProcessInfo()
        return sorted({p["group"] for p in infos if p["statename"] == "FATAL"})
    except (OSError, xmlrpc.client.Error):
        return []
    finally:
        transport.close()


def stop_all_programs(socket_path: Path) -> None:
    """Ask supervisord to send every program its stop signal now, without waiting (best effort). Its own shutdown
    stops one program (group) at a time and notices each exit only on its one-second tick: ~1 s a program, six
    or more a server; signalled together they are all reaped on one tick."""
    transport = SupervisorTransport(None, None, f"unix://{socket_path}")
    try:
        rpc = xmlrpc.client.ServerProxy("http://localhost", transport=transport)
        rpc.supervisor.stopAllProcesses(False)
    except (OSError, xmlrpc.client.Error):
        pass  # not answering (starting, or gone): its own shutdown stops them in order
    finally:
        transport.close()


DRAINING = ("http", "scheduler")  # the programs SIGTERM drains; the others serve their streams meanwhile


def drain(socket_path: Path, timeout: float) -> None:
    """Send every http process and every scheduler SIGTERM, which drains it, and wait until all have exited. An
    http process turns readiness 503, refuses new requests and lets its running streams finish; a scheduler says
    `draining` (the router places nothing new on it) and runs what it holds to its end; each for up to `timeout`.
    The rest of the pipeline keeps running meanwhile: the streams need it (a replica's shards above all)."""
    transport = SupervisorTransport(None, None, f"unix://{socket_path}")
    try:
        rpc = xmlrpc.client.ServerProxy("http://localhost", transport=transport)
        signalled = []
        for group in DRAINING:
            try:
                rpc.supervisor.signalProcessGroup(group, "TERM")
                signalled.append(group)
            except xmlrpc.client.Fault:  # no such program here (--only), or none running
                pass
        deadline = time.monotonic() + timeout + DRAIN_MARGIN_S
        while signalled and time.monotonic() < deadline:
            states = [p["statename"] for p in rpc.supervisor.getAllProcessInfo() if p["group"] in signalled]
            if not any(state in ("STARTING", "RUNNING", "STOPPING") for state in states):
                return
            time.sleep(0.1)
        if signalled:
            log.warning(
                "%s did not drain within %gs; stopping everything", ", ".join(signalled), timeout + DRAIN_MARGIN_S
            )
    except (OSError, xmlrpc.client.Error):
        pass  # not answering (starting, or gone): the plain stop follows
    finally:
        transport.close()


def cannot_load(run_dir: Path) -> list[str]:
    """Programs that wrote their name in the run directory's `cannot-load` file: a start that failed in a way no
    restart mends (services/shard: a model that does not load), so waiting for supervisord's retries is pointless."""
    try:
        return sorted(set((run_dir / "cannot-load").read_text().split()))
    except OSError:
        return []


def die_with_parent():
    """A preexec_fn that makes the child get SIGTERM when this process dies, or None where the platform
    has no parent-death signal."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:  # the parent died before the signal was armed: it will never come
            os._exit(1)

    return preexec


_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our own port: never via an http_proxy


def healthy(url: str) -> bool:
    try:
        with _direct.open(url, timeout=1) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def run(
    conf: Path,
    env: dict[str, str],
    cwd: Path,
    run_dir: Path,
    lock_fd: int | None = None,
    health_url: str | None = None,
    ready_message: str = "",
    drain_timeout: float = 0.0,
) -> int:
    """Run supervisord until it exits. `lock_fd` (the run directory's lock) is inherited by supervisord so
    the lock outlives us until supervisord has stopped everything; once `health_url` answers 200,
    `ready_message` is logged. SIGTERM drains http first (up to `drain_timeout`), then stops the rest; Ctrl-C
    (SIGINT), or a second signal, stops everything at once."""
    cmd = [sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(conf)]
    preexec = die_with_parent()
    if preexec is None:
        log.warning(
            "%s has no parent-death signal: if this launcher is killed outright (kill -9), supervisord and the "
            "services keep running; stop them with `kill <pid in %s/supervisord.pid>`",
            sys.platform,
            run_dir,
        )
    # its own session: a terminal's Ctrl-C reaches only us, and we stop supervisord, which stops the rest
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=preexec,
        pass_fds=() if lock_fd is None else (lock_fd,),
    )
    failed: list[str] = []
    waiting = health_url is not None

    draining: list[threading.Thread] = []

    def drain_then_stop() -> None:
        drain(run_dir / "supervisor.sock", drain_timeout)
        stop()

    def stop(signum=None, frame=None):
        if signum == signal.SIGTERM and not draining and not failed and proc.poll() is None:
            log.info("SIGTERM: draining http and the schedulers (up to %gs), then stopping", drain_timeout)
            draining.append(threading.Thread(target=drain_then_stop, daemon=True))
            draining[0].start()
            return
        if proc.poll() is None:
            # every program signalled at once first (a thread: a hung supervisord must not hang Ctrl-C), then
            # supervisord itself, which waits for them and exits
            stopper = threading.Thread(target=stop_all_programs, args=(run_dir / "supervisor.sock",), daemon=True)
            stopper.start()
            stopper.join(3.0)
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while True:
        try:
            code = proc.wait(timeout=0.5 if waiting else POLL_S)
            return 1 if failed else code
        except subprocess.TimeoutExpired:
            pass
        # a model that does not load stops a starting server at once; once it served, a shard that fails to come
        # back gets supervisord's retries (a passing shortage of memory may let a retry load)
        if not failed and (failed := (waiting and cannot_load(run_dir)) or fatal_programs(run_dir / "supervisor.sock")):
            log.error("%s could not start (see the log above); stopping", ", ".join(failed))
            stop()
        if waiting and not failed and healthy(health_url):
            waiting = False
            log.info("%s", ready_message)
