"""A stand-in for the http process's Ingress, for testing the HTTP layer alone.

It answers from a script of realistic TextRows (the shapes the detokenizer publishes), records what
it was sent, and can fail or block a request; the model itself is never faked here, only the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from libs.protocol.messages import FinalInfo, GenerateRequest, TextRow, TokenizeResult, TokenText
from libs.runtime.liveness import Liveness
from libs.runtime.settings import Settings
from services.http.__main__ import build_app
from services.http.errors import Failure
from services.http.timing import Timing

PROMPT_IDS = [2, 651, 6037]
PROMPT_TEXTS = ["<bos>", "The", " capital"]


def rows(
    request_id: str,
    texts: list[str],
    logprobs: list[float],
    *,
    top_n: int = 0,
    prefill: bool = False,
    seed: int | None = None,
    finish: str = "length",
) -> list[TextRow]:
    """Rows for one request: token i has id 100+i, its text and logprob, and `top_n` alternatives."""
    out = []
    for i, (text, lp) in enumerate(zip(texts, logprobs)):
        tops = [TokenText(id=100 + i + k, text=f"alt{k}", logprob=lp - k, special=False) for k in range(top_n)]
        out.append(
            TextRow(
                request_id=request_id,
                index=i + 1,
                token_id=100 + i,
                text=text,
                logprob=lp,
                special=False,
                top_tokens=tops,
            )
        )
    pre = []
    if prefill:
        lps = [math.nan, -2.5, -0.75]
        pre = [
            TokenText(id=t, text=s, logprob=None if math.isnan(p) else p, special=t == 2)
            for t, s, p in zip(PROMPT_IDS, PROMPT_TEXTS, lps)
        ]
    out[-1].final = FinalInfo(
        generated_text="".join(texts),
        finish_reason=finish,
        generated_tokens=len(texts),
        input_length=len(PROMPT_IDS),
        seed=seed,
        prefill=pre,
    )
    return out


class FakeIngress:
    index = 0

    def __init__(self, answer=None):
        # answer(req, n) -> list[TextRow | Failure] | Failure, n counting the requests so far
        self.answer = answer or (lambda req, n: rows(req.request_id, [" Paris", "."], [-0.5, -1.0]))
        self.sent: list[GenerateRequest] = []
        self.closed: list[str] = []  # requests whose stream was closed before its end (aborted)
        self.liveness = Liveness()
        self.gate: asyncio.Event | None = None  # when set: generation waits for it

    def healthy(self) -> bool:
        return True

    def ready(self, request_id: str) -> bool:
        """Rows here come one at a time (each after a yield to the loop): none waits behind the one in hand."""
        return False

    async def generate(self, req: GenerateRequest, timing: Timing | None = None):
        self.sent.append(req)
        answer = self.answer(req, len(self.sent) - 1)
        done = False
        try:
            if isinstance(answer, Failure):  # failures come at once; rows wait for the gate
                done = True
                raise answer
            if self.gate is not None:
                await self.gate.wait()
            if timing is not None:
                timing.accepted = time.monotonic()
            for row in answer:
                await asyncio.sleep(0)
                if isinstance(row, Failure):  # a failure after some rows: a request that fails mid-stream
                    raise row
                if timing is not None:
                    timing.first = timing.first or time.monotonic()
                    timing.last = time.monotonic()
                done = row.final is not None
                yield row
        finally:
            if not done:
                self.closed.append(req.request_id)

    async def tokenize(self, req: GenerateRequest) -> TokenizeResult:
        self.sent.append(req)
        text = req.inputs
        words = text.split(" ")
        starts, pos = [], 0
        for w in words:  # one token per space-separated word, its leading space included
            starts.append(pos)
            pos += len(w) + 1
        stops = [s + len(w) for s, w in zip(starts, words)]
        starts = [s - 1 if i else s for i, s in enumerate(starts)]
        return TokenizeResult(
            request_id=req.request_id,
            text=text,
            ids=np.arange(len(words), dtype="<i4"),
            starts=np.array(starts, dtype="<u4"),
            stops=np.array(stops, dtype="<u4"),
        )


@contextlib.asynccontextmanager
async def client(ingress: FakeIngress, **settings):
    base = {"model_id": "org/tiny", "max_best_of": 2}
    app = build_app(Settings(**{**base, **settings}), ingress)
    async with TestClient(TestServer(app)) as c:
        yield c


def run(coro):
    return asyncio.run(coro)
