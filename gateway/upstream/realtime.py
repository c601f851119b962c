"""A realtime session's relay: its WebSocket to one of the model's replicas, opened before the
client's upgrade is answered, and the frames between the two, one at a time.

Backpressure is the relay's shape: a frame is read from one side only once the last one was
written to the other (aiohttp's writer waits while the transport's buffer is over its mark, and
its reader stops reading the socket while its queue is full), so a slow client holds the engine's
stream in the engine and the kernel, not in the gateway's memory, and a frame is at most the
side's ``max_msg_size``.

A session ends (the ``reason`` of gateway_realtime_sessions_total) when the client closes it
(``client``: the engine's side closed with 1000), the engine closes it (``engine``: its close code
and reason passed to the client), the engine's connection fails (``engine_lost``: 1011), it is
idle for ``realtime.idle_s`` (``idle``: 1000) or longer than ``realtime.max_session_s``
(``too_long``: 1008), or the gateway stops (``draining``: 1001, once ``server.drain_timeout_s``
is up). Each close says its reason to the client, and waits for each side's answer
``CLOSE_S`` at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import WSMsgType, web

from ..admission.realtime import Refusal, Session
from ..config import ModelConfig
from ..errors import NoHealthyUpstreamError, UpstreamConnectError
from ..metrics import GatewayMetrics
from .attempts import Attempts
from .relay import outcome_of
from .replicas import Lease, Pool
from .usage import Usage, usage_of

log = logging.getLogger("gateway.upstream.realtime")

ENGINE_MAX_MSG = 16 << 20  # an engine's event (a transcription's text): bounded all the same
CLOSE_S = 2.0  # what a side's close waits for its answer
CLOSES = {  # reason -> (the client's close code, what it is told)
    "idle": (1000, "idle for {idle}s (realtime.idle_s)"),
    "too_long": (1008, "the session is over {most}s long (realtime.max_session_s)"),
    "engine_lost": (1011, "the engine's connection was lost"),
    "draining": (1001, "the gateway is shutting down"),
    "error": (1011, "the gateway could not relay the session"),
}


BINARY_REFUSED = Refusal(
    "a binary frame is not an event of the realtime protocol (send JSON text frames)", "invalid_event", "", "invalid"
)


def client_max_msg(model: ModelConfig) -> int:
    """The largest frame a client of ``model`` may send: an append of ``max_append_bytes`` in
    base64, and room for its JSON."""
    return -(-model.realtime.max_append_bytes * 4 // 3) + 4096


class Hub:
    """This process's realtime sessions: the client they open engines' WebSockets with, and
    those relayed now (closed with a reason when the gateway stops)."""

    def __init__(self) -> None:
        self._http: aiohttp.ClientSession | None = None  # made with the first session, on the loop
        self.open: set[Relay] = set()
        self._none = asyncio.Event()  # set while no session is open (bound to no loop until waited on)
        self._none.set()

    def enter(self, relay: Relay) -> None:
        self.open.add(relay)
        self._none.clear()

    def leave(self, relay: Relay) -> None:
        self.open.discard(relay)
        if not self.open:
            self._none.set()

    async def idle(self) -> None:
        """Until no session is open (one's end counted): what a test or a drain waits on."""
        await self._none.wait()

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            # no bound on connections: each session holds one for its length (aiohttp's default of
            # 100 would make the 101st wait, then count against a healthy replica)
            self._http = aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        return self._http

    def stop_all(self, reason: str = "draining") -> None:
        for relay in list(self.open):
            relay.stop(reason)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


async def connect(
    hub: Hub, pool: Pool, model: ModelConfig, headers: Mapping[str, str], metrics: GatewayMetrics
) -> tuple[aiohttp.ClientWebSocketResponse, Lease]:
    """A WebSocket to one of the model's replicas (``/v1/realtime`` under its URL), and the lease
    on it (the replica's load while the session lasts), through the attempt loop: a replica that
    refuses the upgrade or cannot be reached counts against its breaker, and the next is tried
    (each once: nothing reached an engine's generation). None opens: 502 ``upstream_unreachable``,
    or 503 ``no_healthy_upstream`` when no replica admits a try. Each try is counted in
    gateway_upstream_requests_total (``ok``: upgraded)."""
    attempts = Attempts(pool, panic=True)
    timeout = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0)
    failures: list[str] = []
    while (lease := attempts.take()) is not None:
        url = lease.replica.url.rstrip("/").replace("http", "ws", 1) + "/v1/realtime"
        try:
            async with asyncio.timeout(model.timeouts.connect_s):
                ws = await hub.http.ws_connect(
                    url,
                    params={"model": model.upstream_name},
                    headers=headers,
                    timeout=timeout,
                    max_msg_size=ENGINE_MAX_MSG,
                    autoping=True,
                    compress=0,
                )
        except BaseException as exc:  # the lease given back, whatever ended the try (the client left too)
            lease.__exit__()
            if isinstance(exc, aiohttp.WSServerHandshakeError):  # an answer, not an upgrade: its status said
                said, outcome = f"answered {exc.status}", outcome_of(exc.status)
                lease.failure(f"realtime upgrade refused: {exc.status}")
            elif isinstance(exc, aiohttp.ClientError | TimeoutError):
                failure = attempts.failed(lease, exc)
                said, outcome = failure.reason, failure.outcome
            else:
                raise
            failures.append(f"{lease.replica.url}: {said}")
            metrics.child(metrics.upstream_requests, model.name, lease.replica.url, outcome).inc()
            continue
        lease.success()
        metrics.child(metrics.upstream_requests, model.name, lease.replica.url, "ok").inc()
        return ws, lease
    if not failures:
        raise NoHealthyUpstreamError(f"No replica of model '{model.name}' is healthy for a realtime session")
    raise UpstreamConnectError(f"No replica of model '{model.name}' took the realtime session ({'; '.join(failures)})")


class Relay:
    """One session's frames, both ways, until one side ends it or a bound does."""

    def __init__(
        self,
        client: web.WebSocketResponse,
        engine: aiohttp.ClientWebSocketResponse,
        session: Session,
        metrics: GatewayMetrics,
        on_usage: Callable[[Usage], None],
    ) -> None:
        self.client, self.engine, self.session, self.metrics = client, engine, session, metrics
        self._on_usage = on_usage
        self.reason = ""  # why the session ended, once it has (the reason of gateway_realtime_sessions_total)
        self._engine_close: tuple[int, str] = (0, "")  # the engine's close frame: its code and reason
        self._last = time.monotonic()
        self._stopped: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        name = session.model.name
        child = metrics.child
        self._client_events = child(metrics.realtime_events, name, "client")
        self._client_bytes = child(metrics.realtime_bytes, name, "client")
        self._engine_events = child(metrics.realtime_events, name, "engine")
        self._engine_bytes = child(metrics.realtime_bytes, name, "engine")
        self._audio = child(metrics.audio_seconds, name, "realtime")
        self.events = {"client": 0, "engine": 0}  # relayed, each way: the session's span says them

    def stop(self, reason: str) -> None:
        """End the session now (``draining``: the gateway stops)."""
        if not self._stopped.done():
            self._stopped.set_result(reason)

    async def run(self) -> str:
        """Relay until the session ends; the reason it ended (its sides closed with it)."""
        bounds = self.session.model.realtime
        upward = asyncio.create_task(self._from_client(), name="realtime: client to engine")
        downward = asyncio.create_task(self._from_engine(), name="realtime: engine to client")
        started = time.monotonic()
        reason = self.reason = "error"
        try:
            while True:
                now = time.monotonic()
                if now >= started + bounds.max_session_s:
                    reason = "too_long"
                    break
                if now >= self._last + bounds.idle_s:
                    reason = "idle"
                    break
                wait = min(started + bounds.max_session_s, self._last + bounds.idle_s) - now
                waiting: set[asyncio.Future[Any]] = {upward, downward, self._stopped}
                done, _ = await asyncio.wait(waiting, timeout=wait, return_when="FIRST_COMPLETED")
                if self._stopped in done:
                    reason = self._stopped.result()
                    break
                if upward in done:
                    reason = "client" if upward.exception() is None else "error"
                    break
                if downward in done:
                    reason = (
                        "engine" if downward.exception() is None and self._engine_closed_cleanly() else "engine_lost"
                    )
                    break
        except asyncio.CancelledError:
            reason = "client"  # the client's connection went (aiohttp cancels the handler of one lost)
            raise
        finally:
            self.reason = reason
            for task in (upward, downward):
                task.cancel()
            for task in (upward, downward):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for task in (upward, downward):
                if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                    log.warning("realtime session of %s: %s", self.session.model.name, exc, exc_info=exc)
            await self._close(reason)
        return reason

    def _engine_closed_cleanly(self) -> bool:
        """Whether the engine closed the session with a close frame of its own (any code: its 1011
        too, with its reason), not by losing the connection (1006, an error, no code)."""
        code = self.engine.close_code
        return self.engine.exception() is None and code is not None and code != 1006

    async def _close(self, reason: str) -> None:
        """Both sides closed, the client told why."""
        bounds = self.session.model.realtime
        if reason == "client":
            code, message = 1000, ""
        elif reason == "engine":
            code = self._engine_close[0] or self.engine.close_code or 1000
            message = self._engine_close[1] or "the engine closed the session"
        else:
            code, said = CLOSES[reason]
            message = said.format(idle=f"{bounds.idle_s:g}", most=f"{bounds.max_session_s:g}")
        # each side's close waits for its answer, bounded: an engine that keeps sending without
        # answering the close, a client gone quiet, holds the session (its lease, its key's slot) no longer
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_S):
                await self.client.close(code=code, message=message.encode()[:123])
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_S):
                await self.engine.close(code=1000)

    async def _from_client(self) -> None:
        client, engine, session = self.client, self.engine, self.session
        async for message in client:
            self._last = time.monotonic()
            if message.type is WSMsgType.TEXT:
                text = message.data
                try:
                    out, seconds = session.client_event(text)
                except Refusal as refused:
                    self.metrics.child(self.metrics.realtime_refused, session.model.name, refused.reason).inc()
                    await client.send_str(refused.event)
                    continue
                self._client_events.inc()
                self._client_bytes.inc(len(text))
                self.events["client"] += 1
                if seconds:
                    self._audio.inc(seconds)
                await engine.send_str(out)
            elif message.type is WSMsgType.BINARY:
                self.metrics.child(self.metrics.realtime_refused, session.model.name, "invalid").inc()
                await client.send_str(BINARY_REFUSED.event)

    async def _from_engine(self) -> None:
        client, engine = self.client, self.engine
        while True:
            message = await engine.receive()
            if message.type is WSMsgType.CLOSE:  # the engine's own close: its code and reason kept
                self._engine_close = (message.data or 0, message.extra or "")
                return
            if message.type in (WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
            self._last = time.monotonic()
            if message.type is WSMsgType.TEXT:
                text = message.data
                self._engine_events.inc()
                self._engine_bytes.inc(len(text))
                self.events["engine"] += 1
                if '"transcription.done"' in text:
                    self._usage(text)
                await client.send_str(text)
            elif message.type is WSMsgType.BINARY:
                self._engine_events.inc()
                self._engine_bytes.inc(len(message.data))
                self.events["engine"] += 1
                await client.send_bytes(message.data)

    def _usage(self, text: str) -> None:
        """A transcription's usage (``transcription.done``), spent of the key's token budgets."""
        with contextlib.suppress(orjson.JSONDecodeError):
            event = orjson.loads(text)
            usage = event.get("usage") if isinstance(event, dict) else None
            if isinstance(usage, dict) and (found := usage_of(usage)) is not None:
                self._on_usage(found)
