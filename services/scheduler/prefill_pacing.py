"""How many prompt tokens one step may prefill while other requests decode: a cap in tokens, in step time, or both.

On CPU a step's time grows with the prompt tokens it feeds, so a long prompt fed whole stalls every running stream
for its whole prefill. Fed in chunks, the streams wait one chunk per token instead. The chunk is bounded by
- `max_tokens` (--max-prefill-tokens-while-decoding): a fixed number of tokens;
- `max_ms` (--max-prefill-ms-while-decoding): the time a chunk may add to a decode step, turned into tokens with the
  prefill cost per token this replica measured on its own recent steps (each result carries the shard's forward
  seconds). One setting then means the same wait for a small model and a large one, on a slow CPU or a fast
  accelerator, and the chunk shrinks as a long prompt's context, and so attention's cost per token, grows.
Both set: the smaller wins. Neither: no cap (TGI has none).
"""

from __future__ import annotations

# A chunk never goes below this many tokens (one KV block): a prompt always makes progress, even when its measured
# cost per token is above the whole time cap.
MIN_CHUNK = 16
# Before any prefill was measured, a time cap alone lets this many tokens through (a guess on the low side: the
# first measured chunk corrects it).
FIRST_CHUNK = 128
# Steps with fewer prefill tokens than this say little about a token's cost (the decodes' time dominates them).
MIN_SAMPLE_TOKENS = 32
# Weight of the newest step in the running estimates: a long prompt's cost per token grows chunk by chunk.
EMA_WEIGHT = 0.5


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


class PrefillPacing:
    def __init__(self, max_tokens: int = 0, max_ms: float = 0.0):
        self.max_tokens = max_tokens
        self.max_ms = max_ms
        self.decode_s: float | None = None  # forward seconds of a recent step that only decoded
        self.token_s: float | None = None  # forward seconds per prefilled token beyond a decode step's own
        self._planned: dict[int, tuple[int, int]] = {}  # step → (prefill tokens, decode rows), until its result

    def cap(self, decoding: int) -> int | None:
        """Prompt tokens the next step may prefill beside `decoding` decode rows; None: no cap."""
        if not decoding:
            return None
        caps = [self.max_tokens] if self.max_tokens else []
        if self.max_ms:
            if self.token_s:
                caps.append(max(MIN_CHUNK, int(self.max_ms / 1000 / self.token_s)))
            elif not caps:
                caps.append(FIRST_CHUNK)
        return min(caps) if caps else None

    def planned(self, step: int, prefill_tokens: int, decodes: int) -> None:
        if self.max_ms:
            self._planned[step] = (prefill_tokens, decodes)

    def observed(self, step: int, forward_s: float) -> None:
        """A step's result came back after `forward_s` seconds in the shard: update the estimates."""
        shape = self._planned.pop(step, None)
        if shape is None or forward_s <= 0:
            return
        tokens, decodes = shape
        if not tokens:
            self.decode_s = _ema(self.decode_s, forward_s)
        elif tokens >= MIN_SAMPLE_TOKENS:
            base = self.decode_s if decodes and self.decode_s else 0.0
            self.token_s = _ema(self.token_s, max(forward_s - base, 0.0) / tokens)

    def forget(self) -> None:
        """The plans in flight will not be applied."""
        self._planned = {}
