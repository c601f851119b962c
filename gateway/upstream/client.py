"""The faithful relay of a request to one of a model's upstream replicas, retried where safe.

The replica comes from the model's :class:`~gateway.upstream.replicas.Pool` (choice, load, health); each
attempt reports how it went to its lease, which is what ejects a failing replica. A failed attempt
is tried again on a replica not tried yet (:mod:`gateway.upstream.retries` says when): a refused connection
always (nothing reached the engine, so it costs no budget), a reset or a status in
``retries.on_status`` within ``retries.attempts`` and the retry budget. Once a byte of the answer went to
the client, nothing is retried.

Requests go out through the gateway's own HTTP/1.1 client (:mod:`gateway.upstream.http1`), the one
transport of the hop (aiohttp's ``ClientSession`` was a second until issue 41); its errors are read by
:mod:`gateway.upstream.failures` and become :mod:`gateway.errors` here. Bodies are relayed as they arrive
(``iter_any``), so SSE streams reach the client chunk by chunk; compressed bodies pass through
untouched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

from aiohttp import hdrs, web
from multidict import CIMultiDict

from ..config import ModelConfig
from ..errors import (
    EmbeddingsNotDeliveredError,
    NoHealthyUpstreamError,
    NotFoundError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
    clip,
)
from ..metrics import GatewayMetrics
from ..tracing import Span, Tracing
from ..values import record
from .attempts import Attempts
from .dispatch import Dispatch, Timeouts
from .failures import CLIENT_ERRORS, ClientFailure
from .holders import Holders
from .http1 import Http1Client, PoolFull, UnsendableHeader, Waits
from .relay import HOP_BY_HOP, UpstreamReply, outcome_of, relay
from .replicas import Lease, Replica
from .retries import RetryBook

log = logging.getLogger(__name__)

# Request headers the gateway sets itself (or aiohttp computes). The gateway has decoded the body
# (gateway.admission.body), so the client's Content-Encoding no longer describes it.
# x-priority: the client's ask, which its key caps; the class it got goes as X-Gateway-Priority
_NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "expect", "content-encoding", "x-priority"}
# trace context a client sends, passed on within the W3C specifications' bounds (tracestate: 512
# characters; baggage: 8192 bytes), else not at all
BOUNDED_UP = (("tracestate", 512), ("baggage", 8192))
# the headers SDKs and agents send a key in: OpenAI's and most (Authorization), Anthropic's
# (x-api-key), Azure OpenAI's (api-key), Google's (x-goog-api-key); none goes upstream where the
# gateway checks keys itself or server.forward_client_credentials is off
CLIENT_CREDENTIALS = (hdrs.AUTHORIZATION, "x-api-key", "api-key", "x-goog-api-key")

# vLLM and SGLang (uvicorn) close idle keep-alive connections after 5 s; reusing one at that moment
# fails a POST that cannot be retried, so the client pool lets connections go first.
MAX_BUSY_S = 30.0  # the longest a replica that answered 429 is passed over
POOL_FULL_PAUSE_S = 1.0  # a replica whose MAX_CONNECTIONS were all busy for a connect timeout is passed over this long


class UpstreamClient:
    """Sends requests to a model's replicas over the gateway's own HTTP/1.1 client."""

    def __init__(
        self, metrics: GatewayMetrics, *, retries: RetryBook | None = None, tracing: Tracing | None = None
    ) -> None:
        self._metrics = metrics
        self._tracing = tracing  # a span per attempt, its traceparent sent (gateway.tracing)
        self.retries = retries if retries is not None else RetryBook(metrics)  # every model's budget
        self.holders = Holders()  # the replica that holds each stored response (the Responses API)
        self._http1: Http1Client | None = None

    async def start(self) -> None:
        self._http1 = Http1Client()

    async def close(self) -> None:
        if self._http1 is not None:
            await self._http1.close()

    def forward(self, request: web.Request, dispatch: Dispatch) -> Coroutine[Any, Any, web.StreamResponse]:
        """POST ``dispatch.body`` to one of its pool's replicas at the request's path; relay the
        answer. The exchange is the coroutine returned (this prepares it without a frame of its own)."""
        model, timeouts = dispatch.model, dispatch.timeouts
        deadline = None
        if timeouts.total is not None:
            deadline = asyncio.get_running_loop().time() + timeouts.total
        prefer = None
        if dispatch.continues is not None and (held := self.holders.find(dispatch.continues)) is not None:
            prefer, owner = held
            if owner != dispatch.owner:  # another key's stored response: as the engine answers one it lacks
                raise NotFoundError(
                    f"Response with id '{clip(dispatch.continues)}' not found.", param="previous_response_id"
                )
        attempts = Attempts(
            dispatch.pool,
            retries=self.retries.of(model),
            key=dispatch.affinity_key,
            deadline=deadline,
            prefer=prefer,
        )
        headers = _upstream_headers(request, dispatch.gateway_headers, dispatch.content_type)
        if dispatch.auth is not None or not dispatch.forward_client_auth:
            for name in CLIENT_CREDENTIALS:  # the client's key: the gateway's, or not the engine's
                if name in headers:
                    del headers[name]
        if dispatch.auth is not None:
            headers[hdrs.AUTHORIZATION] = dispatch.auth
        # origin-form even when the client sent absolute-form (POST http://host/v1/... HTTP/1.1)
        return self._forward(request, dispatch, attempts, _Sending(request.rel_url.raw_path_qs, headers, timeouts))

    async def _forward(
        self, request: web.Request, dispatch: Dispatch, attempts: Attempts, sending: _Sending
    ) -> web.StreamResponse:
        model = dispatch.model
        while (lease := await attempts.next() if attempts.waits else attempts.take()) is not None:
            if dispatch.continues is not None and len(attempts.tried) == 1:
                self._stored(model, attempts.prefer, lease.replica)
            with lease:
                replica = lease.replica
                started = time.perf_counter()
                span = None if self._tracing is None else self._attempt(replica, sending, len(attempts.tried))
                try:
                    upstream = await self._post(replica, dispatch.body, sending, attempts.left())
                except asyncio.CancelledError:  # the client left (handler cancellation)
                    self._count(model, replica, "aborted", span)
                    raise
                except UnsendableHeader:  # the gateway's own (its config): no replica is blamed or tried
                    self._count(model, replica, "error", span)
                    raise UpstreamError(
                        f"A header the gateway would send to model '{model.name}' holds a line break; nothing was sent"
                    ) from None
                except PoolFull:  # saturated from this gateway's side, not failing: no breaker count
                    self._count(model, replica, "pool_full", span)
                    lease.busy(POOL_FULL_PAUSE_S)
                    continue  # nothing was sent: the next replica may take it; none left: 503 with Retry-After
                except CLIENT_ERRORS as exc:
                    self._failed(attempts, lease, model, exc, dispatch.timeouts, span)
                    continue
                except BaseException as exc:  # none that the attempt loop knows: its span ended, marked
                    self._abandoned(exc, span)
                    raise
                status = upstream.status
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                if status == 429:
                    lease.busy(_retry_after(upstream.headers.get(hdrs.RETRY_AFTER)))
                if status in model.retries.on_status and attempts.again(f"http_{status}"):
                    attempts.failure = None  # a replica answered: if none is left, that is no_healthy_upstream
                    upstream.close()
                    self._count(model, replica, outcome_of(status), span)
                    if status >= 500:  # a 429 is the engine protecting itself, not failing
                        lease.failure(f"HTTP {status}")
                    continue
                metrics = self._metrics
                metrics.child(metrics.upstream_duration, model.name, replica.url).observe(time.perf_counter() - started)
                if status >= 500:
                    lease.failure(f"HTTP {status}")
                else:
                    lease.success()
                relaying = None if span is None else self._relaying(span, dispatch)  # a stream's
                try:
                    async with upstream:
                        relayed = await relay(request, upstream, dispatch, attempts.deadline)
                except asyncio.CancelledError:  # the client left; closing upstream stops the engine
                    self._count(model, replica, "aborted", span, relaying)
                    raise
                except BaseException as exc:  # (the client's connection broke as the answer began)
                    self._abandoned(exc, relaying, span)
                    raise
                if relayed.upstream_failed:
                    lease.failure("broke off mid-response")
                if relayed.response_id is not None:
                    self.holders.remember(relayed.response_id, replica.url, dispatch.owner)
                self._count(model, replica, relayed.outcome, span, relaying)
                error = relayed.error
                if not isinstance(error, EmbeddingsNotDeliveredError) or dispatch.reprime is None:
                    if error is not None:
                        raise error
                    assert relayed.response is not None
                    if dispatch.on_usage is not None and status < 300:
                        dispatch.on_usage(relayed.usage)
                    return relayed.response
                # not the replica's fault: the images are primed again, and every replica may take them
                if not attempts.again("ec_error", anew=True):
                    raise error
                log.warning("model %s: %s; priming its images again", model.name, error.message)
            dispatch = replace(dispatch, body=await dispatch.reprime(), reprime=None)  # outside the lease
        # Replica addresses and errors are logged, not told to clients.
        if attempts.expired:
            raise _out_of_time(model, dispatch.timeouts)
        if attempts.failure is None:
            raise NoHealthyUpstreamError(
                f"Every upstream of model '{model.name}' is failing; retry later",
                headers={"Retry-After": str(dispatch.pool.retry_after())},
            )
        raise attempts.failure

    def _post(self, replica: Replica, body: bytes, sending: _Sending, left: float | None) -> Awaitable[UpstreamReply]:
        """One try's request: its reply's head."""
        timeouts = sending.timeouts
        wait = timeouts.stream_idle  # for the response headers
        if left is not None:
            wait = min(wait or timeouts.read, left)
        assert self._http1 is not None, "UpstreamClient.start() was not called"
        # wait None: sock_read bounds the wait for the head
        return self._http1.post(
            replica.url, sending.path, sending.headers, body, Waits(timeouts.connect, wait, sending.sock_read)
        )

    def _failed(
        self,
        attempts: Attempts,
        lease: Lease,
        model: ModelConfig,
        exc: ClientFailure,
        timeouts: Timeouts,
        span: Span | None,
    ) -> None:
        """A try that failed before any reply: returns when the next replica is tried, raises
        what the client is told otherwise."""
        if attempts.expired:
            self._count(model, lease.replica, "timeout", span)  # the model's limit, not the replica's fault
            raise _out_of_time(model, timeouts)
        failure = attempts.failed(lease, exc)
        self._count(model, lease.replica, failure.outcome, span)
        if failure.kind == "connect":
            # nothing reached the engine: the next replica may take it, whatever the budget
            attempts.failure = UpstreamConnectError(
                f"Could not connect to any upstream of model '{model.name}' ({len(attempts.tried)} tried)"
            )
            attempts.again("connect_error", free=True)
            return
        if failure.kind == "timeout":
            waited = timeouts.stream_idle or timeouts.read
            raise UpstreamTimeoutError(
                f"Upstream of model '{model.name}' sent no response within {waited:g}s"
            ) from None
        attempts.failure = UpstreamError(f"Upstream of model '{model.name}' failed before responding: {failure.reason}")
        if failure.kind == "reset" and attempts.again("reset"):
            return
        raise attempts.failure from None

    def _stored(self, model: ModelConfig, holder: str | None, first: Replica) -> None:
        """Where a request that continues a stored response went first."""
        result = "unknown" if holder is None else "holder" if first.url == holder else "elsewhere"
        self._metrics.child(self._metrics.stored_responses, model.name, result).inc()

    def _count(
        self, model: ModelConfig, replica: Replica, outcome: str, span: Span | None = None, relaying: Span | None = None
    ) -> None:
        """An attempt's outcome, counted (gateway_upstream_requests_total), and its spans ended."""
        self._metrics.child(self._metrics.upstream_requests, model.name, replica.url, outcome).inc()
        if span is not None:
            assert self._tracing is not None
            span.set_attribute("gateway.outcome", outcome)
            for ended in (relaying, span):
                if ended is not None:
                    if outcome == "http_4xx":  # an answer: the request's fault, not the attempt's
                        ended.set_attribute("error.type", outcome)
                    elif outcome != "ok":
                        self._tracing.failed(ended, outcome)
                    ended.end()

    def _abandoned(self, exc: BaseException, *spans: Span | None) -> None:
        """Spans of an attempt that ended in an error nothing else counts: ended, marked."""
        for span in spans:
            if span is not None and span.is_recording():
                assert self._tracing is not None
                self._tracing.failed(span, exc)
                span.end()

    def _attempt(self, replica: Replica, sending: _Sending, attempt: int) -> Span | None:
        """An attempt's span (CLIENT), its traceparent in the headers it sends; None for a
        request not sampled, whose context (not sampled) goes upstream as it is."""
        assert self._tracing is not None
        if not self._tracing.recording():
            self._tracing.inject(sending.headers)
            return None
        span = self._tracing.start(
            "gateway.upstream",
            {
                **_address(replica.url),
                "url.path": sending.path,
                "gateway.attempt": attempt,
                "http.request.method": "POST",
            },
            kind="client",
        )
        self._tracing.inject(sending.headers, span)
        return span

    def _relaying(self, attempt: Span, dispatch: Dispatch) -> Span | None:
        """A stream's relay, from its first byte to its last, under the attempt that answered; a
        reply sent whole is in its attempt's span (its body comes with its end)."""
        assert self._tracing is not None
        if dispatch.timeouts.stream_idle is None:
            return None
        return self._tracing.start("gateway.relay", {"gateway.stream": True}, parent=attempt)


@functools.lru_cache(maxsize=1024)
def _address(replica: str) -> dict[str, str | int]:
    """An attempt span's ``server.address`` and ``server.port``: a replica's, read from its URL once."""
    url = urllib.parse.urlsplit(replica)
    return {"server.address": url.hostname or "", "server.port": url.port or (443 if url.scheme == "https" else 80)}


@record
class _Sending:
    """What every try of one request sends, and how long each may wait."""

    path: str
    headers: CIMultiDict[str]
    timeouts: Timeouts

    @property
    def sock_read(self) -> float | None:
        """A stream's first chunk and gaps are the relay's deadlines (first_byte_s, idle_s), its
        headers the wait of :meth:`UpstreamClient._post`; a non-streamed reply's silence is the
        socket's read timeout."""
        return None if self.timeouts.stream_idle is not None else self.timeouts.read


def _out_of_time(model: ModelConfig, timeouts: Timeouts) -> UpstreamTimeoutError:
    return UpstreamTimeoutError(f"Upstream of model '{model.name}' did not finish within {timeouts.total:g}s")


def _retry_after(value: str | None) -> float:
    """An engine's Retry-After in seconds (1 if absent or a date; at most MAX_BUSY_S)."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), MAX_BUSY_S) if seconds == seconds else 1.0


def _upstream_headers(request: web.Request, extra: Mapping[str, str], content_type: str) -> CIMultiDict[str]:
    headers = request.headers.copy()  # in C; then the few names not forwarded go (cheaper than a filter in Python)
    for name in _NOT_FORWARDED_UP:
        if name in headers:
            del headers[name]
    headers.update(extra)
    for name, most in BOUNDED_UP:  # W3C's bounds: a client's longer context is not passed on
        value = headers.get(name)
        if value is not None and len(value) > most:
            del headers[name]
    if request.remote:
        forwarded = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{forwarded}, {request.remote}" if forwarded else request.remote
    headers[hdrs.CONTENT_TYPE] = content_type
    return headers
