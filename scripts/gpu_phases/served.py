"""Phase 4, served: the six processes over HTTP, tokens equal to the in-process run."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch

from bench.engine import Engine, request
from services.shard.model_runner import ModelRunner

from .common import ROOT
from .identity import tiny_dirs
from .report import Report

WHEELS = ROOT / ".gpu-wheels"
SERVED_MODULES = ("zmq", "msgspec", "orjson", "llguidance", "supervisor", "opentelemetry", "interegular", "gguf")


def served_imports() -> list[str]:
    return [m for m in SERVED_MODULES if importlib.util.find_spec(m) is None]


def install_wheels(work: Path) -> str:
    """Install the serving packages this machine lacks from .gpu-wheels (scripts/gpu_wheels.sh) into a folder
    on sys.path and PYTHONPATH; returns what is still missing, or ''."""
    missing = served_imports()
    if not missing:
        return ""
    if not WHEELS.is_dir():
        return f"missing {missing}; no {WHEELS.name}/ (scripts/gpu_wheels.sh, then carry it)"
    site = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    cmd += sorted(str(w) for w in WHEELS.glob("*.whl"))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return f"pip install from {WHEELS.name}/ failed: {done.stderr[-400:]}"
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    missing = served_imports()
    return f"still missing after install: {missing}" if missing else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_tokens(url: str, text: str, max_new: int) -> list[int]:
    body = json.dumps({"inputs": text, "parameters": {"max_new_tokens": max_new}}).encode()
    req = urllib.request.Request(url + "/generate_stream", body, {"Content-Type": "application/json"})
    ids = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    return ids


def phase4(rep: Report, dev: torch.device, quick: bool, work: Path) -> None:
    from transformers import AutoTokenizer

    why = install_wheels(work)
    if why:
        rep.skip(4, "served", why)
        return
    model_dir = tiny_dirs(work / "tiny")["llama"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()
    texts = [" ".join(words[i % 5 : i % 5 + 3 + 2 * i]) for i in range(4 if quick else 16)]
    max_new = 8 if quick else 24
    runner = ModelRunner(str(model_dir), num_blocks=256, block_size=16, device=dev, grammar=False)
    engine = Engine.build(runner, model_dir)
    outputs = engine.run({0: [request(str(i), tok(t).input_ids, max_new) for i, t in enumerate(texts)]})
    expected = [outputs[str(i)].tokens for i in range(len(texts))]
    del runner, engine

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "serve.log"
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "--model-id", str(model_dir), "--dtype", "float32"]
    cmd += ["--port", str(port), "--hostname", "127.0.0.1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        t = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited {proc.returncode}: {log_path.read_text()[-800:]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t > 180:
                raise TimeoutError(f"not healthy after 180 s: {log_path.read_text()[-800:]}")
            time.sleep(0.2)
        healthy_s = time.monotonic() - t
        got: dict[int, list[int] | str] = {}

        def one(i: int) -> None:
            try:
                got[i] = stream_tokens(url, texts[i], max_new)
            except Exception as e:
                got[i] = f"{type(e).__name__}: {e}"

        t = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        load_s = time.monotonic() - t
        wrong = [i for i in range(len(texts)) if got[i] != expected[i]]
        detail = f"healthy in {healthy_s:.1f} s; {len(texts)} concurrent streams in {load_s:.2f} s"
        detail += f"; differ from the in-process run: {[(i, got[i]) for i in wrong][:3]}" if wrong else "; tokens equal"
        rep.add(4, "served", "fail" if wrong else "ok", detail, healthy_s=healthy_s, load_s=load_s, differ=wrong)
    except Exception as e:
        rep.add(4, "served", "fail", f"{type(e).__name__}: {e}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        (rep.out / "serve.log").write_text(log_path.read_text(errors="replace")[-200_000:])
