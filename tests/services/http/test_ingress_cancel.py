"""A client that leaves just as its request's event arrives must still cancel the handler's wait: asyncio.wait_for
on Python 3.11 returned the event and swallowed the cancel, and such requests ran to their end for no one (CI saw
2 of 20 abandoned requests generate all 300 tokens)."""

from __future__ import annotations

import asyncio

import pytest

from services.http.ingress import next_event


def test_a_cancel_that_lands_with_the_event_is_not_swallowed():
    async def scenario():
        q: asyncio.Queue = asyncio.Queue()
        waiter = asyncio.create_task(next_event(q, 5.0))
        await asyncio.sleep(0)  # it waits on the queue
        q.put_nowait("accepted")  # the event and the client's leaving land in the same turn of the loop
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return q.qsize()

    assert asyncio.run(scenario()) == 1  # the event stays queued; the handler's finally aborts the request


def test_an_event_in_time_is_returned_and_silence_times_out():
    async def scenario():
        q: asyncio.Queue = asyncio.Queue()
        asyncio.get_running_loop().call_later(0.01, q.put_nowait, "row")
        got = await next_event(q, 5.0)
        with pytest.raises(TimeoutError):
            await next_event(q, 0.01)
        return got

    assert asyncio.run(scenario()) == "row"
