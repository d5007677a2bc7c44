"""The scenarios every vision family's shard test runs on its tiny model (tests/vision_models.py), served by the
scheduler's Batcher and the shard's ModelRunner (the in-process engine, plans and results encoded as on the bus):
greedy output token-identical to transformers' generate() on the processor's inputs alone, 8 prompts mixed with
text-only rows (chunked), after preemption, and from a prefix-cache hit on the same image only. A family's test file
makes its `Family` and calls these with its own runner and knobs, and keeps its own specifics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from bench.engine import Engine, request
from libs.protocol.messages import TokenizedRequest, image_pixels, pixel_frames
from services.shard.model_runner import ModelRunner
from services.shard.vision.pixels import PixelFinisher
from services.tokenizer.images.fetch import FetchLimits
from services.tokenizer.images.processor import ImageLimits, ImageProcessor
from tests.vision_models import data_uri, image, processed, reference_generate

MAX_NEW = 8
BLOCK = 4  # KV block size of every runner here: prefix hits count whole blocks
WIDE = (40, 30)


def prompts(other=WIDE, third=WIDE, placeholder: str = "<image>") -> list[tuple[str, list[bytes]]]:
    """The 8 prompts of the mixed scenarios: six with pictures (seeds 1 to 6, seed 1 twice, one prompt with two) and
    two text-only; seeds 2, 4 and 6 are `other`-sized and 3 and 5 `third`-sized, for families whose image tokens
    follow the picture's size."""
    texts = [
        ("Look at <image> and say", [image(1)]),
        ("The <image> picture shows", [image(2, other)]),
        ("Two: <image> then <image> end", [image(3, third), image(4, other)]),
        ("Just a text prompt about the sea and the sky", []),
        ("<image>", [image(5, third)]),
        ("Another plain text row, longer than the others by a few words here", []),
        ("Compare <image> now", [image(1)]),
        ("Story of the <image>", [image(6, other)]),
    ]
    return [(text.replace("<image>", placeholder), pictures) for text, pictures in texts]


@dataclass
class Family:
    """A tiny vision model under test: its folder, the 8 prompts (text with `placeholder` where each picture goes,
    and the pictures) the mixed scenarios send, and the KV blocks its runners get by default."""

    folder: Path
    prompts: list[tuple[str, list[bytes]]]
    num_blocks: int = 64
    placeholder: str = "<image>"
    same_pixels: bool = False  # the tokenizer's pixels must equal the processor's tensor (no views padded)
    make: Callable[..., TokenizedRequest] | None = None  # (rid, text, pictures, max_new); None: as admitted
    images: ImageProcessor = field(init=False)  # the tokenizer service's image path, and its tokenizer
    tokenizer: Tokenizer = field(init=False)

    def __post_init__(self):
        self.images = ImageProcessor(str(self.folder), ImageLimits(fetch=FetchLimits()))
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))

    def runner(self, num_blocks: int | None = None, **kw) -> ModelRunner:
        return ModelRunner(str(self.folder), num_blocks=num_blocks or self.num_blocks, block_size=BLOCK, **kw)

    def request(self, rid: str, text: str, pictures: list[bytes], max_new: int = MAX_NEW) -> TokenizedRequest:
        if self.make is not None:
            return self.make(rid, text, pictures, max_new)
        return self.admitted(rid, text, pictures, max_new)

    def admitted(self, rid: str, text: str, pictures: list[bytes], max_new: int = MAX_NEW) -> TokenizedRequest:
        """The request as the tokenizer admits it: markdown images → the model's image token → the processor's
        placeholders; its ids must be the processor's own on the whole prompt."""
        md = text.replace(self.placeholder, "![]({})").format(*(data_uri(p) for p in pictures))
        prompt, urls = self.images.placeholders(md)
        got = self.images.process(urls)
        ids, placed = self.images.expand(self.tokenizer.encode(prompt).ids, got)
        want = processed(self.folder, text, pictures)
        assert ids == want["input_ids"][0].tolist()
        req = request(rid, ids, max_new)
        if placed:
            req.images = placed
            req.pixel_values, req.pixel_bytes = pixel_frames([p.ravel() for p in got.pixels]).values()
            if self.same_pixels:  # the tiles or images, in order, as the shard finishes them (bytes: bit for bit)
                finisher = PixelFinisher(str(self.folder))
                flat = image_pixels(placed, req.pixel_values, req.pixel_bytes)
                values = np.concatenate([finisher.values(im, px).ravel() for im, px in zip(placed, flat)])
                assert values.tobytes() == want["pixel_values"].numpy().astype(np.float32).ravel().tobytes()
        return req

    def expected(self, text: str, pictures: list[bytes], max_new: int = MAX_NEW) -> list[int]:
        return reference_generate(self.folder, text, pictures, max_new)


def alone(family: Family, runner: ModelRunner, walk: bool = True) -> None:
    """The first prompt with two pictures in turn: each answer is transformers', and they differ (the image, not only
    the text, decides); the tower ran once per image (each tile, for a tiled family) and kept no output after its
    prefill; the language model runs the decoder walk as a text model does (`walk`)."""
    text = family.prompts[0][0]
    outputs, placed = [], 0
    for seed in (1, 2):
        engine = Engine.build(runner, family.folder)
        req = family.request(f"a{seed}", text, [image(seed)])
        placed += len(req.images)
        engine.add(req)
        outputs.append(engine.run()[f"a{seed}"].tokens)
        assert outputs[-1] == family.expected(text, [image(seed)]), seed
    assert outputs[0] != outputs[1]
    assert runner.vision.encoder.images == placed and not runner.vision.cache.outputs
    assert (runner.walk is not None) == walk


def mixed(family: Family, runner: ModelRunner, chunk: int | None = None, **batcher: object) -> Engine:
    """The 8 prompts at once, prefills chunked at `chunk` tokens (None: whole): every answer is transformers'; no
    image is encoded more often than it is placed (the same picture twice: once); nothing is left in the encoder
    cache. Returns the engine (its counters) for the family's own checks."""
    engine = Engine.build(
        runner, family.folder, **({} if chunk is None else {"max_batch_prefill_tokens": chunk}), **batcher
    )
    placed = 0
    for i, (text, pictures) in enumerate(family.prompts):
        req = family.request(f"r{i}", text, pictures)
        placed += len(req.images)
        engine.add(req)
    out = engine.run()
    if chunk is not None:
        assert engine.batcher.counters["chunked_prefills"] > 0
    for i, (text, pictures) in enumerate(family.prompts):
        assert out[f"r{i}"].tokens == family.expected(text, pictures), i
    assert runner.vision.encoder.images <= placed
    assert not runner.vision.cache.pending and not runner.vision.cache.outputs
    return engine


def after_preemption(family: Family, num_blocks: int) -> None:
    """The first 5 prompts, 16 new tokens each, in a KV cache of `num_blocks`: the later rows push the newest out,
    which is admitted again with its images, and every answer is still transformers'."""
    engine = Engine.build(family.runner(num_blocks), family.folder)
    for i, (text, pictures) in enumerate(family.prompts[:5]):
        engine.add(family.request(f"p{i}", text, pictures, max_new=16))
    out = engine.run()
    assert engine.batcher.counters["preemptions"] > 0
    for i, (text, pictures) in enumerate(family.prompts[:5]):
        assert out[f"p{i}"].tokens == family.expected(text, pictures, 16), i


def prefix_hit_on_the_same_image_only(family: Family) -> None:
    """The same prompt and picture again hits every full block but the last, its image's with them, and encodes
    nothing; the same prompt with another picture behind the same placeholders hits only the blocks before the one
    holding the image's first token, encodes that image, and answers otherwise; both answers are transformers'."""
    runner = family.runner()
    engine = Engine.build(runner, family.folder)
    text = f"Look closely at this {family.placeholder} and then tell me what it is"
    engine.add(family.request("first", text, [image(7)]))
    engine.run()
    encoded, c = runner.vision.encoder.images, engine.batcher.counters
    same = family.request("same", text, [image(7)])
    engine.add(same)
    out = engine.run()
    hit = c["prefix_hit_tokens"]
    image_end = max(im.start + im.tokens for im in same.images)
    assert hit == (len(same.input_ids) - 1) // BLOCK * BLOCK and hit > image_end  # the image lies in the hit
    assert runner.vision.encoder.images == encoded  # its blocks were cached: not encoded again
    assert out["same"].tokens == family.expected(text, [image(7)])
    other = family.request("other", text, [image(8)])
    engine.add(other)
    out = engine.run()
    assert c["prefix_hit_tokens"] - hit == other.images[0].start // BLOCK * BLOCK
    assert runner.vision.encoder.images == encoded + len(other.images)
    assert out["other"].tokens == family.expected(text, [image(8)])
    assert out["other"].tokens != out["same"].tokens
