"""`n` choices of one OpenAI request: n sibling GenerateRequests of one `group`, which the scheduler runs off one
prefill of the prompt (services/scheduler/siblings.py). Each sibling has its own request id and, when the client
gave a seed, its own seed derived from it (the first keeps the seed itself), so a seeded request gives the same n
answers every time; with temperature 0 every choice is the greedy answer. Only the first sibling scores the
prompt (echo with logprobs); the others reuse its prompt details."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator

import msgspec

from libs.protocol.messages import GenerateRequest, TextRow
from services.http.errors import Failure
from services.http.generation import collect
from services.http.timing import Timing

MAX_N = 128  # OpenAI's bound on `n`


def check_n(n: int | None, max_concurrent_requests: int) -> int:
    """`n` (absent: 1) within 1 … min(128, the server's concurrency limit: each choice holds a permit); 422 else,
    in vLLM's words."""
    n = 1 if n is None else n
    bound = min(MAX_N, max_concurrent_requests)
    if n < 1:
        raise Failure(f"n must be at least 1, got {n}.", "validation")
    if n > bound:
        raise Failure(f"n must be at most {bound}, got {n}.", "validation")
    return n


def derive_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the seed itself for the first, a 64-bit hash of (seed, index) for the others (so the
    choices of seed s never replay those of seed s + 1)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def siblings(wire: GenerateRequest, n: int) -> list[GenerateRequest]:
    """`wire` as n sibling requests (n == 1: itself)."""
    if n == 1:
        return [wire]
    group, params, out = uuid.uuid4().hex, wire.parameters, []
    for i in range(n):
        p = params
        if params.seed is not None:
            p = msgspec.structs.replace(p, seed=derive_seed(params.seed, i))
        if i and params.decoder_input_details:  # the prompt is scored once, by the first
            p = msgspec.structs.replace(p, decoder_input_details=False)
        rid = wire.request_id if i == 0 else uuid.uuid4().hex
        out.append(msgspec.structs.replace(wire, request_id=rid, parameters=p, group=group))
    return out


def quiet(ingress, wires: list[GenerateRequest], n: int) -> None:
    """The siblings past each first are no requests of their own in TGI's metrics (as best_of's copies)."""
    ids = getattr(ingress, "quiet", None)
    if ids is not None and n > 1:
        ids.update(w.request_id for i, w in enumerate(wires) if i % n)


def share_prompt_details(results: list[list[TextRow]], n: int) -> list[list[TextRow]]:
    """Each sibling's final row given its first sibling's prompt details (only the first asked for them)."""
    if n == 1:
        return results
    out = []
    for i, rows in enumerate(results):
        first = results[i - i % n][-1].final
        final = rows[-1].final
        if i % n and first.prefill and not final.prefill:
            final = msgspec.structs.replace(final, prefill=first.prefill, prefill_greedy=first.prefill_greedy)
            rows = [*rows[:-1], msgspec.structs.replace(rows[-1], final=final)]
        out.append(rows)
    return out


async def collect_all(ingress, wires: list[GenerateRequest], timings: list[Timing | None]) -> list[list[TextRow]]:
    """Every request's rows; the first failure wins and the others are cancelled (closing a stream aborts it)."""
    tasks = [asyncio.create_task(collect(ingress, w, t)) for w, t in zip(wires, timings)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(ingress, wires: list[GenerateRequest]) -> AsyncIterator[tuple[int, TextRow, bool]]:
    """The requests' rows as they come, each with its request's index and whether more rows already wait (the rest
    of a step's: a writer may hold its events until they are in); the first failure is raised and the others are
    cancelled. Closing the iterator cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()

    def more() -> bool:  # rows already pumped (asyncio.Queue's deque), or still at the ingress
        return any(item is not None for item in queue._queue) or any(ingress.ready(w.request_id) for w in wires)

    async def pump(index: int, wire: GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(ingress.generate(wire)) as rows:
                async for row in rows:
                    queue.put_nowait((index, row))
        except Failure as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, w)) for i, w in enumerate(wires)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item[1], Failure):
                raise item[1]
            else:
                yield item[0], item[1], more()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
