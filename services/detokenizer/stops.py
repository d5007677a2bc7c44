"""Stop sequences: finding them in a request's streamed text (TGI's StopSequenceCriteria)."""

from __future__ import annotations


class StopMatcher:
    """Tells, token by token, whether one of a request's stop sequences has appeared in its text.

    TGI tests each stop as a match anchored at the END of the accumulated text, so a token whose text holds
    the stop followed by more characters (e.g. stop "\\n" in a token "\\n\\n" or ".\\nThe") never matches.
    We are deliberately better: a stop matches wherever it appears in the text that ends with the new delta,
    i.e. across token boundaries and in the middle of a token. Only a bounded tail is kept: the last
    (longest stop − 1) characters are enough for a stop that starts before the delta and ends in it, and a
    stop lying wholly in earlier text was already reported when that text arrived. The stop sequence stays
    in the text (TGI does not trim it). Empty stop strings are ignored (TGI would stop on the first token).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._keep = max((len(s) for s in self.stops), default=1) - 1
        self._tail = ""
        self.matched: str | None = None  # the stop that matched (the one that ends first)

    def push(self, delta: str) -> bool:
        """Add a token's text; True when a stop sequence appears in text that ends with this delta."""
        if not self.stops or not delta:
            return False
        text = self._tail + delta
        found = [(pos, s) for s in self.stops if (pos := text.find(s)) >= 0]
        self._tail = text[-self._keep :] if self._keep else ""
        if found:
            self.matched = min(found, key=lambda f: (f[0] + len(f[1]), f[0]))[1]
            return True
        return False
