"""Run supervisord in the foreground: forward Ctrl-C/SIGTERM, give up on a program that cannot start.

supervisord restarts a program that dies; one that keeps dying at start (a model that cannot load)
ends FATAL and would leave a server that never becomes healthy. We ask supervisord over its socket
every few seconds and stop the whole server in that case, with a non-zero exit, as TGI's launcher does.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

log = logging.getLogger("switchyard.launcher")
POLL_S = 2.0


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


def run(conf: Path, env: dict[str, str], cwd: Path, run_dir: Path) -> int:
    cmd = [sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(conf)]
    # its own session: a terminal's Ctrl-C reaches only us, and we stop supervisord, which stops the rest
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    failed: list[str] = []

    def stop(signum=None, frame=None):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while True:
        try:
            code = proc.wait(timeout=POLL_S)
            return 1 if failed else code
        except subprocess.TimeoutExpired:
            pass
        if not failed and (failed := fatal_programs(run_dir / "supervisor.sock")):
            log.error("%s could not start (see the log above); stopping", ", ".join(failed))
            stop()
