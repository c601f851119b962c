"""Upstream replicas, and the faithful relay of a request to one of them.

Replica choice is least-in-flight with round-robin tie-break: LLM requests vary by orders of
magnitude in length, so counting outstanding requests spreads load better than turns alone. A
replica that refuses a connection is skipped for ``server.upstream_cooldown_s`` (unless every
replica of the model is cooling down) and the request moves on to the next one; that retry is safe
because nothing reached the engine. Once bytes were sent, nothing is retried.

aiohttp's client errors are mapped to :mod:`gateway.errors` here and nowhere else. Bodies are
relayed as they arrive (``iter_any``), so SSE streams reach the client chunk by chunk; compressed
bodies pass through untouched (``auto_decompress=False``).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict

from .config import GatewayConfig, ModelConfig
from .errors import NoHealthyUpstreamError, UpstreamConnectError, UpstreamError, UpstreamTimeoutError
from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
    )
)
# Request headers the gateway sets itself (or aiohttp computes). The gateway has decoded the body
# (gateway.body), so the client's Content-Encoding no longer describes it.
_NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "expect", "content-encoding"}
# Response headers the gateway's own server sets.
_NOT_RELAYED_DOWN = HOP_BY_HOP | {"content-length", "server", "date"}

# vLLM and SGLang (uvicorn) close idle keep-alive connections after 5 s; reusing one at that moment
# fails a POST that cannot be retried, so the client pool lets connections go first.
KEEPALIVE_TIMEOUT_S = 4.0


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float  # reaching a replica
    read: float  # the longest silence of the replica (before a non-streamed reply, before a stream's first chunk)
    client_write: float  # the longest a client may take no bytes before it is dropped
    # "stream": true: the longest wait for the response headers, and between two chunks once the
    # first came (the engine sends its headers at once, then queues and prefills); None otherwise
    stream_idle: float | None = None


@dataclass(slots=True)
class Replica:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    last_error: str = ""


class Replicas:
    """Health and load of every upstream URL in the config; state survives reloads by URL."""

    def __init__(self, *, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_url: dict[str, Replica] = {}
        self._turn = itertools.count()
        self.cooldown_s = cooldown_s
        self._clock = clock

    def update(self, config: GatewayConfig) -> None:
        """Track every upstream of the config's models."""
        self.cooldown_s = config.server.upstream_cooldown_s
        self.set_urls(u for m in config.models for u in m.upstreams)

    def set_urls(self, urls: Iterable[str]) -> None:
        self._by_url = {u: self._by_url.get(u) or Replica(u) for u in sorted(set(urls))}

    def choose(self, urls: Iterable[str], tried: set[str]) -> Replica | None:
        candidates = [self._by_url[u] for u in urls if u not in tried and u in self._by_url]
        if not candidates:
            return None
        now = self._clock()
        healthy = [r for r in candidates if r.down_until <= now] or candidates
        least = min(r.in_flight for r in healthy)
        best = [r for r in healthy if r.in_flight == least]
        return best[next(self._turn) % len(best)]

    def all_down(self, urls: Iterable[str]) -> bool:
        now = self._clock()
        return all(self._by_url[u].down_until > now for u in urls if u in self._by_url)

    def mark_down(self, replica: Replica, error: str) -> None:
        replica.down_until = self._clock() + self.cooldown_s
        replica.last_error = error

    def mark_up(self, replica: Replica) -> None:
        replica.down_until = 0.0
        replica.last_error = ""

    def snapshot(self) -> list[dict[str, object]]:
        now = self._clock()
        return [
            {"url": r.url, "in_flight": r.in_flight, "healthy": r.down_until <= now, "last_error": r.last_error}
            for r in self._by_url.values()
        ]


class _Deadlines:
    """The two deadlines of a relayed response, kept by one timer rather than one per chunk.

    A write that has waited ``client_write`` seconds means a client that stopped reading: its
    connection is aborted, which ends the handler and so closes the upstream request (the engine
    stops). An event stream whose engine sent nothing for ``stream_idle`` seconds after a chunk is
    hung: the upstream read fails with a timeout, which the relay turns into an SSE error event.
    """

    __slots__ = ("_handle", "_loop", "_request", "_upstream", "client_stalled", "client_write", "stream_idle",
                 "upstream_idle", "waiting_since", "writing_since")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        *,
        client_write: float,
        stream_idle: float | None,
    ) -> None:
        self._loop, self._request, self._upstream = loop, request, upstream
        self.client_write, self.stream_idle = client_write, stream_idle
        self.writing_since: float | None = None
        self.waiting_since: float | None = None  # None until the first chunk came
        self.client_stalled = self.upstream_idle = False
        self._handle = loop.call_later(min(client_write, stream_idle or client_write), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        writing, waiting = self.writing_since, self.waiting_since
        if writing is not None and now - writing >= self.client_write:
            self.client_stalled = True
            if self._request.transport is not None:
                self._request.transport.abort()
            return
        if self.stream_idle is not None and writing is None and waiting is not None:
            if now - waiting >= self.stream_idle:
                self.upstream_idle = True
                self._upstream.content.set_exception(aiohttp.ServerTimeoutError("stream idle"))
                return
        if writing is not None:
            due = writing + self.client_write
        elif waiting is not None and self.stream_idle is not None:
            due = waiting + self.stream_idle
        else:  # neither writing nor waiting between chunks yet: look again within the shorter span
            due = now + min(self.client_write, self.stream_idle or self.client_write)
        self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


class RelayResponse(web.StreamResponse):
    """A relayed response; ``client_gone`` tells the metrics the client left before the end."""

    client_gone = False


class UpstreamClient:
    """Sends requests to a model's replicas over one shared ClientSession."""

    def __init__(self, replicas: Replicas, metrics: GatewayMetrics) -> None:
        self.replicas = replicas
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    async def start(self, config: GatewayConfig) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.replicas.update(config)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self,
        request: web.Request,
        model: ModelConfig,
        body: bytes,
        *,
        timeouts: Timeouts,
        gateway_headers: Mapping[str, str],
    ) -> RelayResponse:
        """POST ``body`` to one of the model's replicas at the request's path; relay the answer."""
        assert self._session is not None, "UpstreamClient.start() was not called"
        headers = _upstream_headers(request, gateway_headers)
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect, sock_read=timeouts.read)
        # origin-form even when the client sent absolute-form (POST http://host/v1/... HTTP/1.1)
        path = request.rel_url.raw_path_qs
        tried: set[str] = set()
        last_error = ""  # for the replica's health record (readyz)
        known_down = self.replicas.all_down(model.upstreams)
        while (replica := self.replicas.choose(model.upstreams, tried)) is not None:
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                started = time.perf_counter()
                try:
                    # BytesIO: aiohttp streams it rather than warning about a large bytes body
                    async with asyncio.timeout(timeouts.stream_idle):
                        upstream = await self._session.post(
                            replica.url + path, data=io.BytesIO(body), headers=headers, timeout=timeout
                        )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # nothing reached the engine: the next replica may take it
                    last_error = _connect_failure(exc)
                    log.warning("upstream %s of model %s: %s", replica.url, model.name, last_error)
                    self.replicas.mark_down(replica, last_error)
                    self._count(model, replica, "connect_error")
                    continue
                except (TimeoutError, aiohttp.ServerTimeoutError):
                    self._count(model, replica, "timeout")
                    waited = timeouts.stream_idle or timeouts.read
                    raise UpstreamTimeoutError(
                        f"Upstream of model '{model.name}' sent no response within {waited:g}s"
                    ) from None
                except aiohttp.ClientError as exc:
                    self._count(model, replica, "connect_error")
                    raise UpstreamError(
                        f"Upstream of model '{model.name}' failed before responding: {type(exc).__name__}"
                    ) from None
                self.replicas.mark_up(replica)
                self._metrics.upstream_duration.labels(model.name, replica.url).observe(time.perf_counter() - started)
                async with upstream:
                    return await self._relay(request, model, replica, upstream, gateway_headers, timeouts)
            except asyncio.CancelledError:  # the client left (handler cancellation); closing upstream stops the engine
                self._count(model, replica, "aborted")
                raise
            finally:
                replica.in_flight -= 1
        # Replica addresses and errors are logged, not told to clients.
        if known_down:
            raise NoHealthyUpstreamError(
                f"Every upstream of model '{model.name}' is failing ({len(tried)} tried); retry later",
                headers={"Retry-After": str(max(1, round(self.replicas.cooldown_s)))},
            )
        raise UpstreamConnectError(f"Could not connect to any upstream of model '{model.name}' ({len(tried)} tried)")

    async def _relay(
        self,
        request: web.Request,
        model: ModelConfig,
        replica: Replica,
        upstream: aiohttp.ClientResponse,
        gateway_headers: Mapping[str, str],
        timeouts: Timeouts,
    ) -> RelayResponse:
        status = upstream.status
        outcome = "ok" if status < 400 else "http_4xx" if status < 500 else "http_5xx"
        response = RelayResponse(status=status, reason=upstream.reason, headers=_client_headers(upstream))
        response.headers.update(gateway_headers)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        is_sse = upstream.content_type == "text/event-stream"
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        deadlines = _Deadlines(
            loop,
            request,
            upstream,
            client_write=timeouts.client_write,
            stream_idle=timeouts.stream_idle if is_sse else None,
        )
        try:
            async for chunk in upstream.content.iter_any():
                deadlines.writing_since = loop.time()
                await response.write(chunk)
                deadlines.writing_since = None
                deadlines.waiting_since = loop.time()
            deadlines.writing_since = loop.time()
            await response.write_eof()  # within the deadline too: a full buffer waits here
        except ConnectionResetError:  # the client left: stop the engine's work by closing upstream
            upstream.close()
            response.client_gone = True
            outcome = "aborted"
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = "timeout" if deadlines.upstream_idle else "aborted"
            log.warning("upstream %s of %s broke off mid-response: %r", replica.url, model.name, exc)
            if is_sse and "Content-Encoding" not in upstream.headers:  # an event can't go into a compressed stream
                error = (
                    UpstreamTimeoutError(f"Upstream of model '{model.name}' sent nothing for {timeouts.stream_idle:g}s")
                    if deadlines.upstream_idle
                    else UpstreamError(f"Upstream of model '{model.name}' broke off the stream")
                )
                deadlines.writing_since = loop.time()
                await _write_quietly(response, b"data: " + orjson.dumps(error.to_dict()) + b"\n\n")
            elif request.transport is not None:
                request.transport.close()  # a truncated body must not look complete
        finally:
            deadlines.cancel()
            if deadlines.client_stalled:
                log.warning("client took no bytes for %gs; dropped (model %s)", timeouts.client_write, model.name)
        self._count(model, replica, outcome)
        return response

    def _count(self, model: ModelConfig, replica: Replica, outcome: str) -> None:
        self._metrics.upstream_requests.labels(model.name, replica.url, outcome).inc()


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        pass


def _connect_failure(exc: aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError) -> str:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect timeout"
    os_error = exc.os_error
    if isinstance(os_error, ConnectionRefusedError):
        return "connection refused"
    return f"{type(os_error).__name__}: {os_error.strerror or os_error}"


def _upstream_headers(request: web.Request, extra: Mapping[str, str]) -> CIMultiDict[str]:
    headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED_UP)
    headers.update(extra)
    if request.remote:
        forwarded = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{forwarded}, {request.remote}" if forwarded else request.remote
    headers[hdrs.CONTENT_TYPE] = "application/json"
    return headers


def _client_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED_DOWN)
