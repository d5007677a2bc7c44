"""Start and stop the servers a benchmark drives: Switchyard (through its own launcher) and vLLM's CPU build."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"
VLLM_PYTHON = PEERS / "vllm" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own session (so its whole tree is signalled), logging to a file."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None):
        self.name, self.port, self.log_path = name, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # fmt: skip

    def wait_healthy(self, timeout: float, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """Ctrl-C (the launcher and uvicorn both stop cleanly on it), then SIGKILL of what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        try:  # children that outlived their parent (same session, same group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def switchyard(model_dir: Path, log_path: Path, *flags: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "launcher", "serve", "--model-id", str(model_dir)]
    cmd += ["--port", str(port), "--hostname", "127.0.0.1", *flags]
    return Server("switchyard", cmd, port, log_path)


def vllm_status() -> str | None:
    """None when vLLM's CPU build is installed under .peers/vllm, else why not (`make peers` installs it)."""
    if not VLLM_PYTHON.exists():
        return "not installed (.peers/vllm missing: run `make peers`)"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode != 0:
        return "not installed (import vllm failed: " + probe.stderr.strip().splitlines()[-1][:200] + ")"
    return None


def vllm_version() -> str:
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return probe.stdout.strip()


def vllm(
    model_dir: Path, log_path: Path, max_model_len: int, max_num_seqs: int, dtype: str, reserved: str | None = None
) -> Server:
    port = free_port()
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    cmd += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    # CPU KV cache in GiB (vLLM's default takes a large share of RAM; this machine is shared)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "VLLM_TARGET_DEVICE": "cpu"}
    # vLLM on CPU keeps one core out of its OpenMP pool for its front end by default; on a 2-core machine that
    # halves its compute while our shard uses both: give it every core too (override by setting it yourself, or
    # with `reserved`)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved or os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return Server("vllm", cmd, port, log_path, env=env)
