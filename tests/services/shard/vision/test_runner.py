"""A tiny LLaVA served by the scheduler's Batcher and the shard's ModelRunner (the in-process engine, plans and
results encoded as on the bus): greedy output token-identical to transformers' generate() on the processor's
inputs, alone, batched with text-only rows and chunked, after preemption, and from a prefix-cache hit on the image;
the vision tower runs once per image and its output is dropped when the prefill no longer needs it (scenarios.py)."""

from __future__ import annotations

import pytest

from tests.services.shard.vision import scenarios
from tests.vision_models import build_llava


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return scenarios.Family(build_llava(tmp_path_factory.mktemp("llava")), scenarios.prompts())


def test_alone_equals_transformers_and_the_image_matters(llava):
    scenarios.alone(llava, llava.runner())


def test_concurrent_mixed_chunked(llava):
    scenarios.mixed(llava, llava.runner(), chunk=24)  # an image's 16 placeholders fall across chunk boundaries


def test_after_preemption(llava):
    scenarios.after_preemption(llava, num_blocks=24)  # 96 slots


def test_prefix_hit_on_the_same_image_only(llava):
    scenarios.prefix_hit_on_the_same_image_only(llava)
