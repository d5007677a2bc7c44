"""The replica pod's shard waits in its preStop hook until the scheduler exited: what counts as a scheduler."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.exited import scheduler_running


def proc_with(tmp_path: Path, *argvs: list[str]) -> Path:
    tmp_path.mkdir()
    for pid, argv in enumerate(argvs, start=10):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()
    return tmp_path


def test_only_a_running_scheduler_counts(tmp_path):
    assert scheduler_running(proc_with(tmp_path / "a", ["python", "-m", "services.scheduler"]))
    others = [
        ["python", "-m", "services.shard"],
        ["python", "-m", "services.scheduler.exited"],  # the hook itself
        ["sh", "-c", "export X=1 && exec python -m services.scheduler"],  # the container before its exec
    ]
    assert not scheduler_running(proc_with(tmp_path / "b", *others))
