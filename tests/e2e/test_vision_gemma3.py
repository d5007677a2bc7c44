"""End to end on a tiny Gemma 3 vision model (tests/vision_models.py) through the six processes: a markdown image
becomes Gemma3Processor's framed block of soft tokens, whose prefill attends both ways, and /generate gives
transformers' greedy tokens; two images give two answers."""

from __future__ import annotations

import pytest

from tests.e2e.vision_server import markdown_answers, serve
from tests.vision_models import build_gemma3, image

pytestmark = pytest.mark.e2e
gemma3 = serve(build_gemma3, "gemma3")


def test_markdown_image_equals_transformers(gemma3):
    text = "Look closely at <start_of_image> and then say what it is"
    markdown_answers(gemma3, text, [image(1), image(2)], placeholder="<start_of_image>")  # the framed block
