"""Fixtures shared across the tree: the tiny models (built once per session) and the LoRA adapters with their peft
reference; `torch_one_thread`, which the shard and engine tests take for every module."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import ARCHS, build_model


def pytest_configure(config):
    # Under pytest-xdist each worker takes its share of the cores for in-process torch work (references, tiny
    # models): two workers' default teams on the same cores only spin against each other.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.fixture(scope="module")
def torch_one_thread():
    # Tiny models on a shared 2-core box: intra-op threads only spin against each other (~20x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def adapters(tiny_dirs, tmp_path_factory):
    """(arch, name) → folder of each of tests/lora_adapters.py's ADAPTERS, saved by peft on the tiny llama and qwen2."""
    from tests.lora_adapters import build_adapters  # imports peft: only for the tests that ask

    return build_adapters(tiny_dirs, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="session")
def reference(tiny_dirs, adapters):
    """arch → peft's PeftModel holding every adapter (each test sets the one it reads)."""
    from tests.lora_adapters import build_reference

    return build_reference(tiny_dirs, adapters)
