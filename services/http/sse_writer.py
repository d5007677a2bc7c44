"""SSE events written per step, not per token: the events a stream already has in hand go out in one socket
write. A step that carries several tokens of one stream (accepted drafts, or rows that queued up while http was
busy) costs one send() instead of one per token; a stream whose rows come one at a time writes as before."""

from __future__ import annotations

from aiohttp import web

from libs.runtime import metrics


class StepWriter:
    def __init__(self, response: web.StreamResponse):
        self.response = response
        self.parts: list[bytes] = []

    async def add(self, event: bytes, more_ready: bool) -> None:
        """Queue `event`; write what is queued unless more of this stream's rows are already waiting."""
        self.parts.append(event)
        if not more_ready:
            await self.flush()

    async def add_all(self, events: list[bytes], more_ready: bool) -> None:
        """Queue a row's events (a chat token may give several chunks); write as `add` does."""
        self.parts.extend(events)
        if not more_ready:
            await self.flush()

    async def flush(self) -> None:
        if not self.parts:
            return
        m = metrics.get()
        if m is not None:  # a process without metrics (an app under test) still writes
            m.sse_events.inc(len(self.parts))
            m.sse_writes.inc()
        data = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts.clear()
        await self.response.write(data)
