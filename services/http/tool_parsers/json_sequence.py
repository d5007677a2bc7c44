"""Call objects one after another (`{…}; {…}` or `[{…}, {…}]`), the body of the Llama 3 and Mistral formats."""

from __future__ import annotations

from services.http.tool_parsers.base import BLANK, Call, read_call_object


def read_calls(text: str, pos: int, final: bool, separators: str, close: str = "") -> tuple[list[Call], int, bool]:
    """Calls from `pos`: (calls, where reading stopped, whether the sequence ended cleanly or may go on).

    Stops at `close` (consumed), at text that is no call object (left for the caller), or at the end of the text.
    """
    calls: list[Call] = []
    while True:
        while pos < len(text) and text[pos] in BLANK + separators:
            pos += 1
        if close and text.startswith(close, pos):
            return calls, pos + len(close), True
        if pos >= len(text):
            return calls, pos, not final
        call, end = read_call_object(text, pos, complete=final)
        if call is None:
            return calls, pos, False
        calls.append(call)
        if end is None:
            return calls, len(text), not final
        pos = end
