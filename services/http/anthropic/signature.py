"""A thinking block's `signature`: what Anthropic's API attaches to the reasoning it sends, and what its SDK and
Claude Code keep and send back with the block in later turns.

Ours is the block's own fingerprint: URL-safe base64 of SHA-256 over the thinking text (with a prefix naming what
it signs). Anthropic's signature lets its API check that reasoning sent back is what its model wrote, because that
reasoning reaches its model again. A thinking block sent back reaches ours too (the template decides which turns
show it: gpt-oss's and Qwen3's the reasoning of the current tool-call turns), yet it is not verified: the client
writes the whole prompt here (every message, tool result and assistant turn, and on /v1/chat/completions the same
reasoning as `reasoning_content` with no signature), so a check would protect nothing a client cannot already
write; a forgery-proof one would need a secret key shared by every http process and kept across restarts; and it
would refuse conversations a client trimmed or moved from another server. Blocks coming back are accepted with any
signature or none. The same text signs the same on every http process and after a restart, so a block's signature
is stable wherever the conversation goes on.
"""

from __future__ import annotations

import base64
import hashlib

PREFIX = b"switchyard thinking\n"


def sign(thinking: str) -> str:
    digest = hashlib.sha256(PREFIX + thinking.encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")
