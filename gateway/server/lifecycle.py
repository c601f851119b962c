"""Serving the app as a process: listen, and on SIGTERM drain without losing a request.

SIGTERM (or SIGINT) starts the drain::

    /readyz -> 503 "draining"          load balancers stop sending new requests...
    drain_grace_s: still listening     ...but until they notice, new connections are served
    listener closed                    idle keep-alive connections closed
    (realtime sessions open)           drain_timeout_s for them to end, requests in flight going
                                       on; then each closed, 1001 "the gateway is shutting down"
    drain_timeout_s: in flight finish  requests and streams in flight run to their end
    app cleanup                        clients closed, supervised encoders stopped last
    exit 0

A second signal during the grace period ends it at once (the listener closes, requests in flight
still get their ``drain_timeout_s``); a signal after it is logged and changes nothing. SIGINT (a
Ctrl-C at a terminal, where no load balancer is to be waited for) has no grace period: an idle
gateway stops at once, and requests in flight still finish.

A worker of ``serve --workers N`` is served the same way, on a port it shares with the others
(``reuse_port``); it drains too when its master is gone (``parent_pid``), so no worker outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from aiohttp import web

from ..config import ServerConfig
from ..errors import ConfigError
from .access_log import AccessLogWriter, access_logger
from .app import SERVER_OPTIONS
from .state import SERVICES_KEY

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PARENT_CHECK_S = 1.0
CLOSE_WAIT_S = 4.0  # what a realtime session closed at the drain waits for its client's answer


# Young objects a collection of the youngest generation waits for (CPython's default: 700). A
# request makes a few hundred that live to its end, most freed by reference counting; the
# collector's passes over the young ones that still live cost a request more the more often they
# run, and find no garbage there a request left (the gateway makes no cycles a request).
GC_YOUNG = 20_000


def settle_heap() -> None:
    """Once the app is set up: what startup made (modules, the config, the app) moved out of the
    collector's sight (``gc.freeze``: no later collection walks it), and the youngest generation
    collected less often (GC_YOUNG). vLLM's API server freezes its startup heap alike. What
    startup made is still freed when nothing refers to it (a generation a reload replaced); only
    a cycle among it would never be collected: at most once, what one generation holds."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, middle, old)


async def serve(
    app: web.Application,
    address: tuple[str, int],
    server: ServerConfig,
    *,
    access_log: bool,
    reuse_port: bool = False,
    parent_pid: int | None = None,
) -> None:
    """Serve ``app`` on ``address`` (host, port) until a stop signal, then drain (see the module docstring);
    ``access_log``: a line a request (gateway.server.access_log). ``reuse_port``: listen with SO_REUSEPORT (the
    kernel spreads connections over every process listening so); ``parent_pid``: drain as on
    SIGTERM once that process is no longer this one's parent."""
    lines = AccessLogWriter() if access_log else None
    runner = web.AppRunner(
        app,
        keepalive_timeout=server.client_idle_timeout_s,  # also bounds headers that trickle in
        shutdown_timeout=server.drain_timeout_s,
        **({"access_log_class": access_logger(lines)} if lines is not None else {"access_log": None}),
        **SERVER_OPTIONS,
    )
    await runner.setup()
    settle_heap()
    loop = asyncio.get_running_loop()
    signals = asyncio.Queue[signal.Signals]()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError):  # no signals on Windows
            loop.add_signal_handler(sig, signals.put_nowait, sig)
    orphaned = None
    if parent_pid is not None:
        orphaned = asyncio.create_task(_watch_parent(parent_pid, signals), name="parent watch")
    try:
        if (admin := server.admin_address) is not None:  # before any request: the operators' paths are not public
            app[SERVICES_KEY].lifecycle.admin_port = admin[1]
        await listen(web.TCPSite(runner, *address, reuse_port=reuse_port), address)
        if parent_pid is None:  # a worker's master says it for all of them
            store = app[SERVICES_KEY].store
            log.info("serving %d models from %s on http://%s:%d", len(store.current.models), store.path, *address)
        if admin is not None:
            await listen(web.TCPSite(runner, *admin, reuse_port=reuse_port), admin, admin=True)
            log.info("admin endpoints, /metrics and the status page on http://%s only", server.admin_listen)
        first = await signals.get()
        await _drain(app, signals, first, server)
        await _end_sessions(runner, app, server)
    finally:
        if orphaned is not None:
            orphaned.cancel()
        # closes the listener, waits for requests in flight, then app cleanup; a signal now is
        # logged and changes nothing (the default action would kill the process mid-drain)
        try:
            await runner.cleanup()
        finally:
            if lines is not None:
                lines.flush()  # the access log's last lines
        for sig in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
    log.info("stopped")


class CannotListen(Exception):
    """An address the gateway cannot listen on (a port in use, an address not of this machine):
    said in one line by the CLI, not a traceback."""

    def __init__(self, address: tuple[str, int], exc: OSError, *, admin: bool = False) -> None:
        # not uvloop's sentence around it; a name that does not resolve has a negative errno
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        move = "change server.admin_listen" if admin else "serve on another with --port N, or make serve PORT=N"
        super().__init__(
            f"cannot listen on http://{address[0]}:{address[1]}: {reason.lower()}"
            + (f" (another process has the port: {move})" if exc.errno == errno.EADDRINUSE else "")
        )


async def listen(site: web.BaseSite, address: tuple[str, int], *, admin: bool = False) -> None:
    """``site`` listening, or :class:`CannotListen` (``admin``: server.admin_listen's)."""
    try:
        await site.start()
    except OSError as exc:
        raise CannotListen(address, exc, admin=admin) from None


async def _watch_parent(pid: int, signals: asyncio.Queue[signal.Signals]) -> None:
    while os.getppid() == pid:
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("the master (pid %d) is gone; stopping", pid)
    signals.put_nowait(signal.SIGTERM)


async def _drain(
    app: web.Application, signals: asyncio.Queue[signal.Signals], first: signal.Signals, server: ServerConfig
) -> None:
    app[SERVICES_KEY].lifecycle.draining = True
    if first == signal.SIGINT:  # a Ctrl-C: nobody's load balancer to wait for
        log.info("SIGINT: stopping; requests in flight have %gs to finish", server.drain_timeout_s)
    else:
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


async def _end_sessions(runner: web.AppRunner, app: web.Application, server: ServerConfig) -> None:
    """Realtime sessions open at the drain: the listener closed, they have ``drain_timeout_s`` to
    end (requests in flight go on meanwhile), then those left are closed, told why. (Once aiohttp's
    own shutdown begins it reads nothing more of any connection, a session's frames included: so
    this comes before it.) The requests still in flight then have what is left of their
    ``drain_timeout_s``, not another: the drain takes no longer with sessions than without."""
    hub = app[SERVICES_KEY].realtime
    if not hub.open:
        return
    loop = asyncio.get_running_loop()
    closed = loop.time()
    for site in list(runner.sites):
        await site.stop()
    log.info("%d realtime sessions open: they have %gs to end", len(hub.open), server.drain_timeout_s)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(server.drain_timeout_s):
            await hub.idle()
    if hub.open:
        log.info("closing %d realtime sessions: the gateway is shutting down", len(hub.open))
        hub.stop_all()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_S):  # their clients' answers to the close
                await hub.idle()
    # aiohttp's runner takes its shutdown timeout once, when made: what is left of it, for the rest
    # (aiohttp reads a timeout of 0 as none at all: a tenth of a second is the least)
    runner._shutdown_timeout = max(0.1, server.drain_timeout_s - (loop.time() - closed))


async def reload_on_sighup(app: web.Application) -> AsyncIterator[None]:
    """A cleanup context: SIGHUP reloads routing.yaml."""
    store = app[SERVICES_KEY].store
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Any]] = set()

    def reload() -> None:
        task = loop.create_task(reload_quietly(store.reload()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    with contextlib.suppress(NotImplementedError):  # no signals on Windows
        loop.add_signal_handler(signal.SIGHUP, reload)
    yield
    with contextlib.suppress(NotImplementedError):
        loop.remove_signal_handler(signal.SIGHUP)
        # a SIGHUP while the process finishes stopping (an operator's, or a master's) is ignored;
        # the default action would kill it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


async def reload_quietly(reload: Awaitable[Any]) -> None:
    with contextlib.suppress(ConfigError):  # logged and counted by the store
        await reload
