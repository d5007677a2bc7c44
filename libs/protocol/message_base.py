"""The base of every bus message and the wire version (its own module so that `messages` and `step_messages`
both build on it without importing each other)."""

from __future__ import annotations

from typing import ClassVar

import msgspec

# Bumped when a message changes incompatibly; a receiver drops frames of another version, so processes of two
# versions never join one server (they do not see each other's heartbeats) instead of misreading each other.
# 2: images' pixels in two frames (float32 values and uint8 bytes, ImageInput.dtype), Qwen2-VL rows as bytes.
WIRE_VERSION = 2


class Message(msgspec.Struct, tag_field="kind", kw_only=True):
    """Base of every bus message. `FRAMES` names the fields carried as raw arrays, with dtypes."""

    FRAMES: ClassVar[tuple[tuple[str, str], ...]] = ()
    v: int = WIRE_VERSION
