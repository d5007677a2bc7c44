"""The launcher gives up, cleanly, on a model that cannot load."""

from __future__ import annotations

import json
import shutil

import pytest

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
