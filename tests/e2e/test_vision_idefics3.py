"""End to end on a tiny Idefics3 (tests/vision_models.py) through the six processes: a markdown image becomes
Idefics3Processor's tiles (rows x columns and the global image, each a framed run of placeholders) as prompt tokens,
and /generate gives transformers' greedy tokens; two images give two answers; an OpenAI image_url part counts its
tiles' tokens in usage."""

from __future__ import annotations

import pytest

from tests.e2e.vision_server import markdown_answers, serve
from tests.vision_models import build_idefics3, image, prompt_ids

pytestmark = pytest.mark.e2e
idefics3 = serve(build_idefics3, "idefics3")


def test_markdown_image_equals_transformers(idefics3):
    markdown_answers(idefics3, "Look closely at <image> and then say what it is", [image(1), image(2)])


def test_chat_image_part_counts_its_tiles(idefics3):
    tiles = len(prompt_ids(idefics3.folder, "<image>", [image(3)]))  # the image's expansion alone
    assert idefics3.chat_prompt_tokens(image(3), max_tokens=2) > tiles
