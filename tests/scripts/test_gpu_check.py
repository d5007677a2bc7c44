"""scripts/gpu_check.py on a CPU in --quick mode: the probe, the kernel check and the identity phase, run as the
device session runs them, then its JSON read back: every phase says what it did, nothing failed, and the tiny
architectures matched generate(). Without CUDA and without TRITON_INTERPRET the kernel phase and the Triton
backend skip with their reason (Triton 3.6's interpreter needs the shims tests/services/shard/attention/
test_triton.py patches in; the kernel's own tests run it there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_phases_on_cpu(tmp_path):
    cmd = [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--quick", "--device", "cpu"]
    cmd += ["--phase", "0", "--phase", "1", "--phase", "2"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert {r["phase"] for r in rows} == {0, 1, 2}
    assert all(r["status"] == "skip" and r["detail"] for r in rows if r["phase"] == 1)
    assert not [r for r in rows if r["status"] == "fail"]
    by_check = {r["check"]: r for r in rows}
    assert by_check["copy bandwidth"]["values"]["gb_per_s"] > 0
    assert by_check["bf16 matmul"]["values"]["tflops"] > 0
    assert report["meta"]["torch"] and report["meta"]["device"] == "cpu"
    for arch in ("llama", "qwen2", "gemma2", "gemma3"):
        assert by_check[f"{arch} float32 torch"]["status"] == "ok"
        assert by_check[f"{arch} bf16 teacher-forced torch"]["status"] == "ok"
    assert "| phase | check | status | detail |" in (tmp_path / "gpu_check.md").read_text()
