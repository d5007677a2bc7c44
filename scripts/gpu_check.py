"""The device check: the one script a GPU session runs (`python scripts/gpu_check.py --out DIR`), in phases.

0 probe: versions, TF32 off, measured copy bandwidth and bf16 matmul rate. 1 kernel: the Triton paged attention
against the torch path on random paged caches (float32, bf16). 2 identity: the tiny architectures through
ModelRunner and the in-process engine (staggered joins, chunked prefill) token-identical to transformers'
generate() in float32, and bf16 teacher-forced within tolerance. 3 speed: a Llama-3-8B-shaped bf16 model built in
memory, 1 to 256 streams, per attention backend, against the roof and transformers' own generation. 4 served: the
six processes over HTTP, tokens equal to the in-process run. Each phase adds its rows to DIR/gpu_check.json and
DIR/gpu_check.md (a re-run phase replaces its own rows). `--quick`: tiny shapes, so it runs on a CPU; what needs
CUDA says so in a skipped row.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.gpu_phases.identity import phase2  # noqa: E402
from scripts.gpu_phases.kernel import phase1  # noqa: E402
from scripts.gpu_phases.probe import phase0  # noqa: E402
from scripts.gpu_phases.report import Report  # noqa: E402
from scripts.gpu_phases.served import phase4  # noqa: E402
from scripts.gpu_phases.speed import phase3  # noqa: E402

PHASES = (0, 1, 2, 3, 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--phase", type=int, action="append", choices=PHASES, help="phases to run (repeat); all if none")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: runs on a CPU in seconds")
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ap.add_argument("--speed-budget", type=float, default=210.0, help="seconds phase 3 may take (then it skips)")
    args = ap.parse_args(argv)
    phases = sorted(set(args.phase or PHASES))
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 identity needs plain float32 products
    torch.backends.cudnn.allow_tf32 = False
    rep = Report(args.out, phases)
    rep.meta.update(device=str(dev), quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        for phase in phases:
            t = time.monotonic()
            try:
                if phase == 0:
                    phase0(rep, dev, args.quick)
                elif phase == 1:
                    phase1(rep, dev, args.quick)
                elif phase == 2:
                    phase2(rep, dev, args.quick, work)
                elif phase == 3:
                    phase3(rep, dev, args.quick, args.speed_budget)
                else:
                    phase4(rep, dev, args.quick, work)
            except Exception as e:  # one phase's crash leaves the others to run
                rep.add(phase, "phase", "fail", f"{type(e).__name__}: {e}")
            rep.meta[f"phase{phase}_s"] = round(time.monotonic() - t, 1)
            rep.write()
    failed = [r for r in rep.rows if r["status"] == "fail" and r["phase"] in phases]
    print(f"{len(failed)} failed; {rep.md_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
