"""The life of a service process: settings from the environment, logging, a clean stop."""

from __future__ import annotations

import logging
from collections.abc import Callable

from libs.runtime import bus, logs
from libs.runtime.settings import Settings


def run(role: str, body: Callable[[Settings, logging.Logger], None]) -> None:
    """Run `body` until SIGTERM (supervisord's stop) or Ctrl-C, then close every socket at once."""
    settings = Settings.from_env()
    log = logs.setup(role, settings.index)
    bus.exit_on_sigterm()
    try:
        body(settings, log)
    except KeyboardInterrupt:
        pass
    finally:
        bus.context().destroy(linger=0)
