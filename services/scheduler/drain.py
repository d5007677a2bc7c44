"""A replica's graceful drain: SIGTERM makes its heartbeat say `draining` at once (the router places nothing new on
it), the requests it holds run to their end for up to --graceful-termination-timeout, then the scheduler exits.
SIGINT, or a second SIGTERM, stops it at once.

A drained scheduler waits `SETTLE_S` after its draining heartbeat before it exits: a request the router placed
just before it heard that beat is then in our inbox, and runs. A request still running at the timeout is cut by
the exit, which first answers it `Unknown` as a restarted scheduler would: http resubmits it (docs/recovery.md), to
another replica where there is one.
"""

from __future__ import annotations

import signal
import socket
import time

from libs.runtime.timeouts import HEARTBEAT_S

SETTLE_S = HEARTBEAT_S  # after the draining beat went out, before an idle replica exits


class Drain:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self.since: float | None = None  # when SIGTERM came (monotonic); None: not draining
        self.announced: float | None = None  # when the first draining heartbeat went out
        # a signal writes a byte here, which wakes the loop's poll at once (the handler alone would wait for it)
        self._wake_read, self._wake_write = socket.socketpair()
        for end in (self._wake_read, self._wake_write):
            end.setblocking(False)

    def install(self) -> None:
        """SIGTERM starts the drain (replacing service.run's stop); the wake-up end goes in the loop's poller."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.set_wakeup_fd(self._wake_write.fileno(), warn_on_full_buffer=False)

    def _on_sigterm(self, signum, frame) -> None:
        if self.since is not None:  # a second SIGTERM: stop now
            raise KeyboardInterrupt
        self.since = time.monotonic()

    @property
    def active(self) -> bool:
        return self.since is not None

    def wake_fd(self) -> int:
        return self._wake_read.fileno()

    def woken(self) -> None:
        """Empty the wake-up socket (its bytes only woke the poll)."""
        try:
            while self._wake_read.recv(4096):
                pass
        except BlockingIOError:
            pass

    def beat_sent(self) -> None:
        if self.active and self.announced is None:
            self.announced = time.monotonic()

    def outcome(self, holding: int) -> str | None:
        """Why the scheduler stops now, holding `holding` requests: "drained" (none left, and the router has had
        its time to hear of the drain), "timeout" (some still run), or None: go on."""
        if self.since is None:
            return None
        now = time.monotonic()
        if now - self.since >= self.timeout:
            return "drained" if holding == 0 else "timeout"
        if holding == 0 and self.announced is not None and now - self.announced >= SETTLE_S:
            return "drained"
        return None
