"""The launcher gives up, cleanly, on a model that cannot load; its Ctrl-C stops every program at once."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from launcher.supervise import stop_all_programs
from tests.e2e.server import Server

pytestmark = pytest.mark.e2e


def test_a_model_that_cannot_load_stops_the_server(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_architecture"}))
    server = Server(broken, tmp_path / "server.log")
    code = server.proc.wait(timeout=240)  # the shard fails to load; the launcher stops everything
    assert code != 0
    log = server.log_path.read_text()
    assert "shard could not start" in log
    assert "no_such_architecture" in log  # the log says why
    server.stop(clean_log=False)  # nothing left behind: no process, no run directory


def test_ctrl_c_signals_every_program_at_once(tiny_model_dir, tmp_path):
    """What the launcher's Ctrl-C does before stopping supervisord: every program gets its stop signal in one call
    (supervisord's own shutdown goes a program a second). Seen as every process STOPPED, none restarted, while
    supervisord still answers; then the usual Ctrl-C leaves nothing behind."""
    with Server(tiny_model_dir, tmp_path / "server.log") as server:
        stop_all_programs(Path(server.run_dir()) / "supervisor.sock")
        deadline = time.monotonic() + 30
        while {p["statename"] for p in server.rpc("getAllProcessInfo")} != {"STOPPED"}:
            assert time.monotonic() < deadline, server.rpc("getAllProcessInfo")
            time.sleep(0.1)
        assert len(server.rpc("getAllProcessInfo")) == 6  # router, scheduler, shard, tokenizer, detokenizer, http
