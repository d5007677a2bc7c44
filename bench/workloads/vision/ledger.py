"""The vision workload's image metrics, read from /metrics against what the run has sent."""

from __future__ import annotations

import asyncio
import time

from bench.serving import loadgen

IMAGE_METRICS = ("switchyard_request_images", "switchyard_image_preprocess_seconds", "switchyard_image_encode_seconds")


async def scrape(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        return loadgen.parse_metrics(await resp.text())


class Ledger:
    """The image metrics against what this run has sent. A tokenizer counts every request (the images it carried, 0
    for text, and their preprocessing time: one snapshot of its metrics), a scheduler every encoder step; both reach
    /metrics in the metrics texts that heartbeats carry, a beat or more late. `counted` polls until every request
    sent and every encoder step known to be due is there, so that a snapshot between two turns splits them. Encoder
    steps are known exactly only for images that come one at a time (c=1): several at once share steps."""

    def __init__(self, url: str):
        self.url, self.base = url, None
        self.requests = 0  # requests sent
        self.encodes = 0  # encoder steps they must have taken (at least)

    def sent(self, requests: int, encodes: int = 0) -> None:
        self.requests += requests
        self.encodes += encodes

    async def counted(self, timeout: float = 30) -> dict[str, float]:
        """The image metrics' counts and sums once everything sent is counted (or, once `timeout` s pass with nothing
        more counted, as they are: then what was counted becomes the ledger's, so that a request the server never
        read stalls no later poll). A tokenizer still working through the images of a flood's closed requests keeps
        counting: the wait goes on while it does."""
        async with loadgen.aiohttp.ClientSession() as session:
            deadline, last = time.monotonic() + timeout, None
            while True:
                m = await scrape(session, self.url)
                now = {f"{n}_{s}": m.get(f"{n}_{s}", 0.0) for n in IMAGE_METRICS for s in ("count", "sum")}
                if self.base is None:
                    self.base = now
                seen = delta(now, self.base)
                requests, encodes = (
                    seen["switchyard_request_images_count"],
                    seen["switchyard_image_encode_seconds_count"],
                )
                if requests >= self.requests and encodes >= self.encodes:
                    return now
                if (requests, encodes) != last:
                    deadline, last = time.monotonic() + timeout, (requests, encodes)
                if time.monotonic() > deadline:
                    self.requests, self.encodes = int(requests), int(encodes)
                    return now
                await asyncio.sleep(0.1)


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}
