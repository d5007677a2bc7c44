"""The event bus for an asyncio process (http): the twin of libs.runtime.bus.EventBus on zmq.asyncio.

Same sockets, same Hello-until-it-comes-back start, same heartbeat (with metrics), same decoding: all of it
from `bus.BusEnds`; only the waiting is asyncio's. It does not say goodbye on a clean stop (the synchronous
services' `bus.say_goodbye`): no process holds work on an http process's word.
"""

from __future__ import annotations

import time

import zmq
import zmq.asyncio

from libs.protocol import Addresses, codec
from libs.protocol.message_base import Message
from libs.runtime.bus import HELLO_EVERY, BusEnds


class AsyncEventBus(BusEnds):
    """One asyncio process's PUB and SUB on the router's event proxy, plus its heartbeat."""

    def __init__(self, addresses: Addresses, role: str, index: int, subscribe: list[bytes]):
        super().__init__(addresses, role, index, subscribe, ctx=zmq.asyncio.Context.instance())

    async def publish(self, topic: bytes, msg: Message) -> None:
        await self.pub.send_multipart(codec.encode_pub(topic, msg), copy=False)

    async def recv(self) -> tuple[bytes, Message] | None:
        return self.decode(await self.sub.recv_multipart(copy=False))

    async def start(self, timeout: float | None = None) -> None:
        """Wait until our own Hello comes back through the proxy (for ever by default: http has nothing to
        serve before); what else arrives meanwhile is dropped, as EventBus.start does."""
        hello = self.hello()
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            await self.publish(self.hb_topic, hello)
            if await self.sub.poll(HELLO_EVERY * 1000) and self.echoes(await self.recv(), hello):
                return
        raise TimeoutError("event bus did not echo our hello: is the router running?")

    async def heartbeat(self, **load) -> None:
        """Publish a heartbeat if one is due (see `BusEnds._beat`)."""
        hb = self._beat(load)
        if hb is not None:
            await self.publish(self.hb_topic, hb)
