"""End to end on a tiny LLaVA-Next (tests/vision_models.py) through the six processes: markdown images of two sizes
become LlavaNextProcessor's placeholders, as many as each size gives (anyres), and /generate gives transformers'
greedy tokens; two images give two answers."""

from __future__ import annotations

import pytest

from tests.e2e.vision_server import markdown_answers, serve
from tests.vision_models import build_llava_next, image

pytestmark = pytest.mark.e2e
llava_next = serve(build_llava_next, "llava_next")


def test_markdown_images_of_two_sizes_equal_transformers(llava_next):
    text = "Look closely at <image> and then say what it is"
    (wide, _), (tall, _) = markdown_answers(llava_next, text, [image(1), image(2, (24, 40))])
    assert len(wide) != len(tall)  # 40x30 and 24x40: 70 and 46 placeholders
