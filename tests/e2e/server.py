"""Start a real Switchyard through the launcher, wait until healthy, stop it and check it cleaned up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import xmlrpc.client
from pathlib import Path

import requests
from supervisor.xmlrpc import SupervisorTransport

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
# A KV cache of 16k tokens for the real models' servers (the default is 64k): the shard zeroes its KV pages at start,
# 2.4-3 GB for Gemma-3-270M and SmolLM2 by default, which took 35-60 s of a test's setup on a VM whose memory is
# backed on first touch. The tests that serve them need a few thousand tokens at most.
SMALL_KV = ("--max-batch-total-tokens", "16384")


def session_processes(sid: int) -> list[int]:
    """Pids of live processes in session `sid` (supervisord and its programs share one)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


class Server:
    """A launcher serving on a free port. As a context manager it waits until healthy on entry and stops on exit
    (`clean_log` False where the test provokes errors on purpose)."""

    def __init__(
        self,
        model_dir: str | Path | None,
        log_path: Path,
        *flags: str,
        env: dict | None = None,
        clean_log: bool = True,
    ):
        """`model_dir` None serves the embedded default model."""
        self.clean_log = clean_log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "launcher", "serve", "--port", str(self.port), "--hostname", "127.0.0.1"]
        cmd += [*(["--model-id", str(model_dir)] if model_dir else []), *flags]
        if "--dtype" not in flags:  # the exact mode: outputs are compared with transformers' float32 generate()
            cmd += ["--dtype", "float32"]
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def __enter__(self) -> Server:
        try:
            self.wait_healthy()
        except BaseException:
            self.stop(self.clean_log)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop(self.clean_log)

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)  # a short poll: every test module waits here for its server
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def run_dir(self) -> str:
        m = re.search(r"run directory (\S+)\)", self.log_path.read_text())
        assert m, "the launcher did not log its run directory"
        return m.group(1)

    def rpc(self, method: str, *args):
        """Call supervisord's XML-RPC interface (supervisor.<method>)."""
        transport = SupervisorTransport(None, None, f"unix://{self.run_dir()}/supervisor.sock")
        try:
            rpc = xmlrpc.client.ServerProxy("http://localhost", transport=transport)
            return getattr(rpc.supervisor, method)(*args)
        finally:
            transport.close()

    def pid(self, program: str, n: int = 0) -> int:
        """The pid of process n of a program (its group), from supervisord (0 while it is not running)."""
        return self.rpc("getProcessInfo", f"{program}:{program}_{n}")["pid"]

    def env(self, program: str, n: int = 0) -> dict[str, str]:
        """The environment a running process was started with (to start one more by hand)."""
        raw = Path(f"/proc/{self.pid(program, n)}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)

    def supervisord_sid(self) -> int | None:
        pid_file = Path(self.run_dir()) / "supervisord.pid"
        try:
            return os.getsid(int(pid_file.read_text()))
        except (OSError, ValueError):
            return None

    def stop(self, clean_log: bool = True) -> None:
        """Ctrl-C the launcher; assert nothing is left: no process, no run directory, and (unless
        the test provoked errors) no traceback in the log."""
        run_dir, sid = self.run_dir(), self.supervisord_sid()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()
        deadline = time.monotonic() + 10
        while sid is not None and session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sid is None or not session_processes(sid), "processes left behind after Ctrl-C"
        assert not os.path.exists(run_dir), "run directory left behind"
        if clean_log:
            assert "Traceback" not in self.log_path.read_text(errors="replace"), self.tail(100)
