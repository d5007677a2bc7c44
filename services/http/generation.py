"""What every generation route shares, whichever API: TGI's permits, the one way a request becomes a
GenerateRequest on the bus, and collecting a request's rows."""

from __future__ import annotations

import contextlib
import time
import uuid

from aiohttp import web

from libs.protocol.messages import GenerateRequest, TextRow
from libs.protocol.params import Parameters
from services.http import models, telemetry
from services.http.errors import Failure
from services.http.timing import Timing


class Permits:
    """TGI's semaphore, shared by every route: no waiting, an immediate 429 when full; best_of N and N
    completion prompts take N."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    @contextlib.contextmanager
    def hold(self, n: int = 1):
        if self.in_flight + n > self.limit:
            telemetry.count_overloaded(n)  # TGI counts a 429 as a request and a failure{err="overloaded"}
            raise Failure("Model is overloaded", "overloaded")
        self.in_flight += n
        try:
            yield
        finally:
            self.in_flight -= n


def bus_request(request: web.Request, ingress: int, parameters: Parameters, **fields) -> GenerateRequest:
    """The GenerateRequest for `request`: a fresh id of ours, this ingress, the client's trace context, the served
    model it chose (services/http/models.py); `fields` are the rest (inputs, mode, stream, the chat's messages…)."""
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        ingress=ingress,
        parameters=parameters,
        received_at=time.time(),
        traceparent=request.headers.get("traceparent"),
        model=models.choose(request, parameters),
        **fields,
    )


async def collect(ingress, wire: GenerateRequest, timing: Timing | None) -> list[TextRow]:
    """Every row of `wire` up to its final one; raises Failure. Closing early (cancelled) aborts it."""
    async with contextlib.aclosing(ingress.generate(wire, timing)) as rows:
        return [row async for row in rows]
