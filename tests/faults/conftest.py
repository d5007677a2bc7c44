"""Fault and soak tests (minutes each): run by `make test-faults`, skipped by a plain `make test`.

They reuse the end-to-end servers of tests/e2e (the tiny model)."""

from __future__ import annotations

import os

from tests.e2e.conftest import tiny_model_dir, tiny_server  # noqa: F401  (fixtures shared with tests/e2e)

# `make test` collects every test under tests/; these only run when asked for
if os.environ.get("SWITCHYARD_FAULTS") != "1":
    collect_ignore_glob = ["test_*.py"]
