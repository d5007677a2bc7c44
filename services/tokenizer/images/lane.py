"""Requests that carry images, processed off the tokenizer's loop on a few threads of lower CPU priority.

Fetching a URL waits on the network (up to --image-fetch-timeout), and decoding and preprocessing a picture costs
milliseconds of CPU: done inline, either would hold up every text request behind it. The lane's threads run at a
higher nice value (--image-nice), so on a host whose cores the shard keeps busy the kernel gives them what decoding
leaves: images wait, running streams keep their pace. The loop polls `fd` and collects what is `ready()`.

The threads call the same Processor as the loop (tokenizers, jinja and llguidance all take concurrent calls); they
touch no socket. The loop keeps reading its inbox whatever the lane holds, so a text request never waits behind an
image; what the lane may hold is bounded by http's --max-concurrent-requests. The tokenizer's heartbeats name the
requests the lane `holds`, so that http's watchdog, which resubmits a request not accepted within a few seconds,
hears them while they wait behind other images; a request in the lane dies with the process like any other (its
beats stop naming it, and http resubmits it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from libs.protocol.messages import GenerateRequest

THREADS = 4  # a fetch that waits on a slow host holds one; the others go on (their CPU work takes turns: processor.py)
log = logging.getLogger("switchyard.tokenizer")


class Lane:
    def __init__(self, work: Callable[[GenerateRequest], object], nice: int) -> None:
        self.work = work
        self.nice = nice
        self._held: Counter[str] = Counter()  # request ids submitted, not yet collected
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._read, self._write = os.pipe()  # a byte per finished request wakes the loop's poller
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            THREADS, thread_name_prefix="images", initializer=self._lower_priority
        )

    @property
    def fd(self) -> int:
        return self._read

    @property
    def pending(self) -> int:
        return self._held.total()

    def holds(self) -> list[str]:
        """The ids of the requests in the lane (submitted, not yet collected)."""
        return list(self._held)

    def held(self, request_id: str) -> bool:
        return request_id in self._held

    def submit(self, req: GenerateRequest) -> None:
        self._held[req.request_id] += 1
        self._pool.submit(self._run, req, time.perf_counter())

    def ready(self) -> list[tuple[GenerateRequest, object, float]]:
        """The requests done since the last call: each with its result and its seconds in the lane (queueing
        included). An exception the work raised is raised here, on the loop, as it would have been inline."""
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                req, result, started = self._done.get_nowait()
            except queue.Empty:
                break
            self._held[req.request_id] -= 1
            if not self._held[req.request_id]:
                del self._held[req.request_id]
            if isinstance(result, BaseException):
                raise result
            out.append((req, result, time.perf_counter() - started))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, req: GenerateRequest, started: float) -> None:
        try:
            result = self.work(req)
        except BaseException as e:  # noqa: BLE001 -- handed to the loop, which raises it
            result = e
        self._done.put((req, result, started))
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already: the loop will collect this one too
            pass

    def _lower_priority(self) -> None:
        # Linux: setpriority on a thread id sets that thread's nice alone
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(self.nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except OSError as e:
            log.warning("image threads keep the tokenizer's CPU priority: %s", e)
