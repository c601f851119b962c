"""Serving the app as a process: listen, and on SIGTERM drain without losing a request.

SIGTERM (or SIGINT) starts the drain::

    /readyz -> 503 "draining"          load balancers stop sending new requests...
    drain_grace_s: still listening     ...but until they notice, new connections are served
    listener closed                    idle keep-alive connections closed
    drain_timeout_s: in flight finish  requests and streams in flight run to their end
    app cleanup                        clients closed, supervised encoders stopped last
    exit 0

A second signal during the grace period ends it at once (the listener closes, requests in flight
still get their ``drain_timeout_s``); a signal after it is logged and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from .app import SERVER_OPTIONS
from .config import ServerConfig
from .state import SERVICES_KEY

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve(
    app: web.Application, host: str, port: int, server: ServerConfig, *, access_log_format: str | None
) -> None:
    """Serve ``app`` on host:port until a stop signal, then drain (see the module docstring);
    ``access_log_format`` None: no access log."""
    runner = web.AppRunner(
        app,
        keepalive_timeout=server.client_idle_timeout_s,  # also bounds headers that trickle in
        shutdown_timeout=server.drain_timeout_s,
        **({"access_log_format": access_log_format} if access_log_format else {"access_log": None}),
        **SERVER_OPTIONS,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    signals = asyncio.Queue[signal.Signals]()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError):  # no signals on Windows
            loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        await web.TCPSite(runner, host, port).start()
        if (admin := server.admin_address) is not None:
            await web.TCPSite(runner, *admin).start()
            app[SERVICES_KEY].lifecycle.admin_port = admin[1]
            log.info("admin endpoints and /metrics on http://%s only", server.admin_listen)
        first = await signals.get()
        await _drain(app, signals, first, server)
    finally:
        # closes the listener, waits for requests in flight, then app cleanup; a signal now is
        # logged and changes nothing (the default action would kill the process mid-drain)
        await runner.cleanup()
        for sig in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
    log.info("stopped")


async def _drain(
    app: web.Application, signals: asyncio.Queue[signal.Signals], first: signal.Signals, server: ServerConfig
) -> None:
    app[SERVICES_KEY].lifecycle.draining = True
    log.info(
        "%s: draining; /readyz answers 503, new connections are served %gs more, then requests in flight "
        "have %gs to finish",
        first.name,
        server.drain_grace_s,
        server.drain_timeout_s,
    )
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(server.drain_grace_s):
            second = await signals.get()
            log.info("%s: grace period cut short", second.name)
    log.info("closing the listener")
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:  # later signals: said, not obeyed
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, log.info, "%s: already draining; requests in flight finish first", sig.name)
