"""Every module here runs torch on one thread (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread(torch_one_thread):
    yield
