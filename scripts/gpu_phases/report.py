"""The report: every phase's rows, written to gpu_check.json and gpu_check.md after each row."""

from __future__ import annotations

import json
from pathlib import Path


class Report:
    """The rows of every phase run into --out so far: (phase, check, status, detail, values); written after each
    row, so a run cut short still leaves what it measured."""

    def __init__(self, out: Path, phases: list[int]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = out / "gpu_check.json", out / "gpu_check.md"
        old = json.loads(self.json_path.read_text()) if self.json_path.exists() else {}
        self.rows = [r for r in old.get("rows", []) if r["phase"] not in phases]
        self.meta = old.get("meta", {})

    def add(self, phase: int, check: str, status: str, detail: str = "", **values) -> None:
        row = dict(phase=phase, check=check, status=status, detail=detail, values=values)
        self.rows.append(row)
        print(f"[phase {phase}] {status:4} {check}: {detail}", flush=True)
        self.write()

    def skip(self, phase: int, check: str, why: str) -> None:
        self.add(phase, check, "skip", why)

    def value(self, phase: int, check: str, key: str):
        for r in self.rows:
            if r["phase"] == phase and r["check"] == check and key in r["values"]:
                return r["values"][key]
        return None

    def write(self) -> None:
        self.rows.sort(key=lambda r: r["phase"])
        self.json_path.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1, default=str))
        lines = ["| phase | check | status | detail |", "|---|---|---|---|"]
        for r in self.rows:
            detail = str(r["detail"]).replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['phase']} | {r['check']} | {r['status']} | {detail} |")
        self.md_path.write_text("\n".join(lines) + "\n")
