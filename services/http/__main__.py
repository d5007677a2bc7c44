"""`python -m services.http`: the aiohttp server."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from libs.runtime import logs
from libs.runtime.settings import Settings
from services.http.anthropic.routes import AnthropicRoutes
from services.http.drain import Drain
from services.http.generation import Permits
from services.http.ingress import Ingress
from services.http.middleware import middlewares
from services.http.openai.routes import OpenAIRoutes
from services.http.responses_api.routes import ResponsesRoutes
from services.http.tgi.routes import Routes

ROLE = "http"
TIMEOUT_MESSAGE = "the server is shutting down: the request did not finish before it stopped"


def build_app(settings: Settings, ingress, drain: Drain | None = None) -> web.Application:
    """The app with every route and TGI's layers (CORS, API key, payload limit), and the drain's when given."""
    layers = middlewares(settings)
    if drain is not None:  # inside CORS, so a refusal carries its headers too
        layers.insert(1, drain.middleware)
    # aiohttp stops reading a body past client_max_size; the payload middleware turns that into TGI's 413
    app = web.Application(client_max_size=settings.payload_limit, middlewares=layers)
    permits = Permits(settings.max_concurrent_requests)  # one semaphore for both APIs, as TGI's
    openai = OpenAIRoutes(settings, ingress, permits)
    Routes(settings, ingress, permits, openai).install(app)
    openai.install(app)
    ResponsesRoutes(settings, ingress, permits).install(app)
    AnthropicRoutes(settings, ingress, permits).install(app)
    return app


async def serve(settings: Settings, log: logging.Logger) -> None:
    ingress = Ingress(settings.bus, settings.index)
    await ingress.start()
    drain = Drain()
    app = build_app(settings, ingress, drain)
    # a client that disconnects cancels its handler, which aborts its request (Ingress.generate)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    # --http-workers processes share the port: the kernel spreads connections over them (SO_REUSEPORT);
    # each has its own ingress index, so the events of its requests come back to it alone (out.<index>)
    site = web.TCPSite(runner, settings.hostname, settings.port, reuse_port=True)
    await site.start()
    log.info("listening on http://%s:%d (ingress %d)", settings.hostname, settings.port, settings.index)
    # SIGTERM drains for the graceful termination timeout; SIGINT (supervisord's stop signal for http, or a
    # second signal) ends what still runs at once, each stream with its error event
    stop = asyncio.Event()
    timeout = settings.graceful_termination_timeout
    cut = asyncio.Event()

    def on_signal(sig: int) -> None:
        if sig == signal.SIGINT or stop.is_set():
            cut.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()
    drain.begin()
    log.info("draining: %d requests running, up to %gs", drain.in_flight, 0 if cut.is_set() else timeout)
    idle = asyncio.ensure_future(drain.wait_idle(timeout))
    cutting = asyncio.ensure_future(cut.wait())
    await asyncio.wait([idle, cutting], return_when=asyncio.FIRST_COMPLETED)
    cutting.cancel()
    if not (idle.done() and idle.result()):
        idle.cancel()
        ended = await ingress.end_all(TIMEOUT_MESSAGE, "unavailable")
        log.warning("drain cut short: %d requests ended with an error", ended)
        await drain.wait_idle(5.0)  # their error events written
    log.info("drained")
    await runner.cleanup()
    await ingress.stop()


def main() -> None:
    settings = Settings.from_env()
    log = logs.setup(ROLE, settings.index)
    asyncio.run(serve(settings, log))


if __name__ == "__main__":
    main()
