"""A vision-language model's images in a prompt: found as TGI's markdown images (`![](url)`, which the chat
template also writes for OpenAI's image_url parts), fetched, decoded, and run through the model's own processor
(transformers' AutoProcessor of the folder, its PIL image path), which gives each image's pixel values and the
placeholder tokens it stands for. Those tokens replace the image's one placeholder in the tokenized prompt, so they
count as prompt tokens everywhere (usage, max_input_tokens, truncation)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from libs.protocol.messages import ImageInput
from services.tokenizer.images import idefics3, smolvlm
from services.tokenizer.images.decode import ImageError, decode
from services.tokenizer.images.fetch import FetchLimits, load
from services.tokenizer.images.qwen2_vl import FAMILIES as QWEN_FAMILIES
from services.tokenizer.images.qwen2_vl import QwenImageProcessor

MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)]*)\)")  # TGI's chunking of `inputs` into text and images


@dataclass(frozen=True)
class ImageLimits:
    fetch: FetchLimits = FetchLimits()
    max_pixels: int = 50_000_000  # before decoding: a bigger header is refused (a decompression bomb)
    max_images: int = 8  # per request


@dataclass
class Images:
    """A prompt's images, processed: each one's placeholder tokens and pixels."""

    token_ids: list[np.ndarray] = field(default_factory=list)  # per image: the tokens its placeholder becomes
    pixels: list[np.ndarray] = field(default_factory=list)  # per image: float32 values, or uint8 (BYTES_FAMILIES)
    sizes: list[list[int]] = field(default_factory=list)  # per image: (height, width) where the processor gives it
    seconds: float = 0.0  # fetching, decoding and preprocessing them


# families whose processor (its PIL path) rescales and normalizes each image or view last, after every resize, crop
# and pad, all on uint8: called without those two it gives exact uint8 pixels, which travel as bytes (a quarter of
# float32's) and which the shard finishes as the processor does (services/shard/vision/pixels.py). Idefics3 and
# SmolVLM pad their tiles after normalizing, but a padded tile is refused (images/idefics3.py): theirs are whole.
# Qwen2-VL's patchify comes after the two as well (images/qwen2_vl.py sends one temporal copy of each row).
BYTES_FAMILIES = {"llava", "llava_next", "gemma3", "idefics3", "smolvlm", *QWEN_FAMILIES}


def digest(pixels: np.ndarray, image_size: list[int] = ()) -> str:
    """The content hash of an image's preprocessed pixels (dtype and shape included) and, where the model reads it,
    its size before preprocessing (LLaVA-Next unpads its tiles by it): equal inputs, equal embeddings."""
    h = hashlib.blake2b(digest_size=16)
    values = np.ascontiguousarray(pixels, "u1" if pixels.dtype == np.uint8 else "<f4")
    h.update(values.dtype.str.encode())
    h.update(np.asarray(pixels.shape, "<i8").tobytes())
    if len(image_size):
        h.update(np.asarray(image_size, "<i8").tobytes())
    h.update(values.tobytes())
    return h.hexdigest()


class ImageProcessor:
    def __init__(self, model_path: str, limits: ImageLimits = ImageLimits()) -> None:
        self.processor = _model_processor(model_path)
        self.limits = limits
        # one image decoded and preprocessed at a time, whatever the threads calling (the tokenizer's lane): they
        # are there to wait on downloads, and a tokenizer process stays one core's worth of work
        self._cpu = threading.Lock()
        self.image_token: str = self.processor.image_token
        self.image_token_id: int = self.processor.image_token_id
        self.placeholder_id: int = _placeholder_id(self.processor)
        # an image cut into tiles, each its own run of placeholders and its own ImageInput (images/idefics3.py)
        self.tiled = _model_type(model_path) in idefics3.FAMILIES
        # pixels as uint8 before rescale and normalize (BYTES_FAMILIES), where the processor runs its PIL path
        image_processor = getattr(self.processor, "image_processor", None)
        self.sends_bytes = (
            _model_type(model_path) in BYTES_FAMILIES and getattr(image_processor, "backend", None) == "pil"
        )

    @classmethod
    def for_model(cls, settings) -> ImageProcessor | None:
        """The processor of the served model when it takes images (its config names a vision tower), else None."""
        from libs.runtime import model_store

        try:
            if not model_store.model_info(settings.model_path).get("takes_images"):
                return None
        except model_store.ModelNotAvailableError:
            return None
        domains = tuple(d for d in settings.allowed_media_domains.split(",") if d)
        fetch = FetchLimits(
            max_bytes=settings.max_image_bytes,
            timeout_s=settings.image_fetch_timeout_s,
            max_redirects=settings.image_fetch_max_redirects,
            allowed_domains=domains,
        )
        limits = ImageLimits(fetch, max_pixels=settings.max_image_pixels, max_images=settings.max_images_per_request)
        return cls(settings.model_path, limits)

    def placeholders(self, text: str, part_urls: list[str] = ()) -> tuple[str, list[str]]:
        """`text` with each markdown image replaced by the model's image token, and the images' URLs in prompt
        order. `part_urls`: image parts the model's own chat template wrote as its image token, in message order;
        each such token takes the next of them."""
        pending = list(part_urls)
        urls: list[str] = []

        def image(match: re.Match) -> str:
            if match.group(1) is not None:
                urls.append(match.group(1))
            elif pending:
                urls.append(pending.pop(0))
            return self.image_token

        pattern = re.compile(f"{MARKDOWN_IMAGE.pattern}|{re.escape(self.image_token)}")
        text = pattern.sub(image, text) if part_urls else MARKDOWN_IMAGE.sub(image, text)
        if pending:
            raise ImageError(f"the chat template did not place {len(pending)} of the request's images")
        if len(urls) > self.limits.max_images:
            raise ImageError(f"a request may hold at most {self.limits.max_images} images, this one has {len(urls)}")
        return text, urls

    def process(self, urls: list[str]) -> Images:
        """Fetch, decode and preprocess each image (ImageError with the reason for the first that fails)."""
        started = time.perf_counter()
        out = Images()
        for url in urls:
            data = load(url, self.limits.fetch)
            with self._cpu:
                img = decode(data, self.limits.max_pixels)
                finish = {"do_rescale": False, "do_normalize": False} if self.sends_bytes else {}
                got = self.processor(
                    text=self.image_token, images=[img], add_special_tokens=False, return_tensors="np", **finish
                )
            if self.tiled:
                idefics3.check_mask(got)
            out.token_ids.append(np.asarray(got["input_ids"][0], np.int32))
            pixels = got["pixel_values"][0]
            if self.sends_bytes and pixels.dtype != np.uint8:
                raise ImageError(f"the processor gave {pixels.dtype} pixels before rescale, not uint8")
            out.pixels.append(np.ascontiguousarray(pixels, np.uint8 if self.sends_bytes else np.float32))
            sizes = got.get("image_sizes")  # LLaVA-Next's: the model tiles and unpads the image by it
            out.sizes.append([] if sizes is None else [int(x) for x in sizes[0]])
        out.seconds = time.perf_counter() - started
        return out

    def expand(self, ids: list[int], images: Images) -> tuple[list[int], list[ImageInput]]:
        """The prompt ids with each image token replaced by its image's tokens, and where each image's placeholder
        tokens now lie (a tiled image's: each tile's)."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images.pixels):
            raise ImageError(
                f"the prompt holds {len(at)} image placeholders ({self.image_token!r}) for {len(images.pixels)} images"
            )
        out, placed, prev = [], [], 0
        for pos, tokens, pixels, size in zip(at, images.token_ids, images.pixels, images.sizes, strict=True):
            out += ids[prev:pos]
            if self.tiled:
                runs = idefics3.tiles(tokens, self.placeholder_id, pixels)
            else:
                marks = np.flatnonzero(tokens == self.placeholder_id)  # e.g. Gemma 3's frame: the placeholders within
                if len(marks) != marks[-1] - marks[0] + 1:
                    raise ImageError("the processor's placeholder tokens for an image are not contiguous")
                runs = [(int(marks[0]), len(marks), pixels)]
            for offset, count, px in runs:
                placed.append(
                    ImageInput(
                        digest=digest(px, size),
                        start=len(out) + offset,
                        tokens=count,
                        shape=list(px.shape),
                        image_size=size,
                        dtype=str(px.dtype),
                    )
                )
            out += tokens.tolist()
            prev = pos + 1
        return out + ids[prev:], placed


def _placeholder_id(processor) -> int:
    """The token each image embedding replaces: the prompt's image token, or where that token only opens the
    image's frame (Gemma 3's <start_of_image>), the tokenizer's image token inside it (Gemma 3's soft tokens)."""
    inner = getattr(getattr(processor, "tokenizer", None), "image_token_id", None)
    return inner if isinstance(inner, int) else processor.image_token_id


def _model_type(model_path: str) -> str | None:
    from libs.runtime import model_store

    return model_store.read_config(model_path).get("model_type")


def _model_processor(model_path: str):
    """The folder's own processor (transformers' AutoProcessor), or Qwen2-VL's or SmolVLM2's image part alone
    (qwen2_vl.py, smolvlm.py)."""
    from transformers import AutoProcessor

    if _model_type(model_path) in QWEN_FAMILIES:
        return QwenImageProcessor(model_path)
    if _model_type(model_path) in smolvlm.FAMILIES:
        return smolvlm.SmolVLMImageProcessor(model_path)
    return AutoProcessor.from_pretrained(model_path)


def template_image_urls(messages: list[dict] | None, text: str) -> list[str]:
    """The URLs of the messages' image parts that the rendered prompt does not hold as markdown images: those the
    model's own template wrote as its image token."""
    from services.tokenizer.chat_template import image_part_url

    urls = []
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            url = image_part_url(part)
            if url is not None and f"![]({url})" not in text:
                urls.append(url)
    return urls


def has_image_parts(messages: list[dict]) -> bool:
    """Whether OpenAI chat messages hold an image part."""
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and (part.get("type") == "image_url" or "image_url" in part) for part in content
        ):
            return True
    return False


def holds_images(inputs: str | None, messages: list[dict] | None) -> bool:
    """Whether a request may carry images: a markdown image in its inputs or in a message's text, or an image part.
    Cheap, and never false for a request that has one (the tokenizer's lane takes those off its loop)."""
    if messages is None:
        return inputs is not None and MARKDOWN_IMAGE.search(inputs) is not None
    if has_image_parts(messages):
        return True
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else [content]:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str) and MARKDOWN_IMAGE.search(text):
                return True
    return False
