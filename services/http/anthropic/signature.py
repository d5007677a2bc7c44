"""A thinking block's `signature`: what Anthropic's API attaches to the reasoning it sends, and what its SDK and
Claude Code keep and send back with the block in later turns.

Ours is the block's own fingerprint: URL-safe base64 of SHA-256 over the thinking text (with a prefix naming what
it signs). Anthropic's signature lets its API check that reasoning sent back is what its model wrote, because that
reasoning reaches its model again. Here it never does: a thinking (or redacted_thinking) block sent back is left
out of the prompt (the chat templates drop earlier turns' reasoning), so there is nothing to protect, and checking
it would only refuse conversations that are valid. Blocks coming back are accepted with any signature or none.
The same text signs the same on every http process and after a restart, so a block's signature is stable
wherever the conversation goes on.
"""

from __future__ import annotations

import base64
import hashlib

PREFIX = b"switchyard thinking\n"


def sign(thinking: str) -> str:
    digest = hashlib.sha256(PREFIX + thinking.encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")
