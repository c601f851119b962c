"""The faithful relay of a request to one of a model's upstream replicas, retried where safe.

The replica comes from the model's :class:`~gateway.replicas.Pool` (choice, load, health); each
attempt reports how it went to its lease, which is what ejects a failing replica. A failed attempt
is tried again on a replica not tried yet (:mod:`gateway.retries` says when): a refused connection
always (nothing reached the engine, so it costs no budget), a reset or a status in
``retries.on_status`` within ``retries.attempts`` and the retry budget. Once a byte of the answer went to
the client, nothing is retried.

aiohttp's client errors are mapped to :mod:`gateway.errors` here and nowhere else. Bodies are
relayed as they arrive (``iter_any``), so SSE streams reach the client chunk by chunk; compressed
bodies pass through untouched (``auto_decompress=False``).
"""

from __future__ import annotations

import asyncio
import io
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict

from .config import ModelConfig
from .errors import (
    GatewayError,
    NoHealthyUpstreamError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
)
from .metrics import GatewayMetrics
from .replicas import Lease, Pool, Replica
from .retries import RetryBudget, backoff

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

    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._clock = clock  # the retry budget's
        self._rng = rng or random.Random()
        self._sleep = sleep  # the backoff's (tests inject one)
        self._budgets: dict[str, RetryBudget] = {}  # by model name, across reloads
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self,
        request: web.Request,
        model: ModelConfig,
        pool: Pool,
        body: bytes,
        *,
        timeouts: Timeouts,
        gateway_headers: Mapping[str, str],
        auth: str | None = None,
    ) -> RelayResponse:
        """POST ``body`` to one of ``pool``'s replicas at the request's path; relay the answer.

        ``gateway_headers`` go both ways; ``auth`` (the model's key) only upstream, in place of
        the client's Authorization."""
        budget = self._budgets.get(model.name) or self._budgets.setdefault(model.name, RetryBudget(self._clock))
        budget.request()
        attempts = _Attempts(model, budget)
        headers = _upstream_headers(request, gateway_headers)
        if auth is not None:
            headers[hdrs.AUTHORIZATION] = auth
        return await self._forward(request, model, pool, body, attempts, timeouts, headers, gateway_headers)

    async def _forward(
        self,
        request: web.Request,
        model: ModelConfig,
        pool: Pool,
        body: bytes,
        attempts: _Attempts,
        timeouts: Timeouts,
        headers: CIMultiDict[str],
        gateway_headers: Mapping[str, str],
    ) -> RelayResponse:
        assert self._session is not None, "UpstreamClient.start() was not called"
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect, sock_read=timeouts.read)
        # origin-form even when the client sent absolute-form (POST http://host/v1/... HTTP/1.1)
        path = request.rel_url.raw_path_qs
        while True:
            if attempts.delay:
                await self._sleep(attempts.delay)
                attempts.delay = 0.0
            lease = pool.lease(exclude=attempts.tried)
            if lease is None:
                break
            attempts.tried.append(lease.replica)
            with lease:
                replica = lease.replica
                started = time.perf_counter()
                try:
                    # BytesIO: aiohttp streams it rather than warning about a large bytes body
                    async with asyncio.timeout(timeouts.stream_idle):
                        upstream = await self._session.post(
                            replica.url + path, data=io.BytesIO(body), headers=headers, timeout=timeout
                        )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # nothing reached the engine: the next replica may take it, whatever the budget
                    self._failed(lease, model, "connect_error", _connect_failure(exc))
                    attempts.failure = UpstreamConnectError(
                        f"Could not connect to any upstream of model '{model.name}' ({len(attempts.tried)} tried)"
                    )
                    if pool.available(exclude=attempts.tried):
                        self._metrics.retries.labels(model.name, "connect_error").inc()
                    continue
                except (TimeoutError, aiohttp.ServerTimeoutError):
                    self._failed(lease, model, "timeout", "read timeout")
                    waited = timeouts.stream_idle or timeouts.read
                    raise UpstreamTimeoutError(
                        f"Upstream of model '{model.name}' sent no response within {waited:g}s"
                    ) from None
                except asyncio.CancelledError:  # the client left (handler cancellation)
                    self._count(model, replica, "aborted")
                    raise
                except aiohttp.ClientError as exc:  # reset, or a response that is not HTTP
                    self._failed(lease, model, "reset", type(exc).__name__)
                    failure = UpstreamError(
                        f"Upstream of model '{model.name}' failed before responding: {type(exc).__name__}"
                    )
                    reset = isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)
                    if not (reset and self._retries(pool, attempts, "reset")):
                        raise failure from None
                    attempts.failure = failure
                    continue
                status = upstream.status
                if status in model.retries.on_status and self._retries(pool, attempts, f"http_{status}"):
                    upstream.close()
                    self._count(model, replica, "http_5xx" if status >= 500 else "http_4xx")
                    if status >= 500:  # a 429 is the engine protecting itself, not failing
                        lease.failure(f"HTTP {status}")
                    continue
                self._metrics.upstream_duration.labels(model.name, replica.url).observe(time.perf_counter() - started)
                if status >= 500:
                    lease.failure(f"HTTP {status}")
                else:
                    lease.success()
                try:
                    async with upstream:
                        return await self._relay(request, model, lease, upstream, gateway_headers, timeouts)
                except asyncio.CancelledError:  # the client left; closing upstream stops the engine
                    self._count(model, replica, "aborted")
                    raise
        # Replica addresses and errors are logged, not told to clients.
        if attempts.failure is None:
            raise NoHealthyUpstreamError(
                f"Every upstream of model '{model.name}' is failing; retry later",
                headers={"Retry-After": str(pool.retry_after())},
            )
        raise attempts.failure

    def _retries(self, pool: Pool, attempts: _Attempts, reason: str) -> bool:
        """Whether the attempt that just failed for ``reason`` is tried again; if so, count it and
        set the backoff the next attempt waits first."""
        model, config = attempts.model, attempts.model.retries
        if attempts.retries >= config.attempts or not pool.available(exclude=attempts.tried):
            return False
        if not attempts.budget.withdraw(config):
            self._metrics.retries_refused.labels(model.name).inc()
            return False
        attempts.retries += 1
        attempts.delay = backoff(attempts.retries, config, self._rng)
        self._metrics.retries.labels(model.name, reason).inc()
        return True

    def _failed(self, lease: Lease, model: ModelConfig, outcome: str, reason: str) -> None:
        log.warning("upstream %s of model %s: %s", lease.replica.url, model.name, reason)
        lease.failure(reason)
        self._count(model, lease.replica, outcome)

    async def _relay(
        self,
        request: web.Request,
        model: ModelConfig,
        lease: Lease,
        upstream: aiohttp.ClientResponse,
        gateway_headers: Mapping[str, str],
        timeouts: Timeouts,
    ) -> RelayResponse:
        replica = lease.replica
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
            lease.failure("broke off mid-response")
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


@dataclass(slots=True)
class _Attempts:
    """One request's way through its pool."""

    model: ModelConfig
    budget: RetryBudget
    tried: list[Replica] = field(default_factory=list)
    retries: int = 0  # retries that counted (a refused connection does not)
    delay: float = 0.0  # the backoff before the next attempt
    failure: GatewayError | None = None  # what the client is told when no attempt is left


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
