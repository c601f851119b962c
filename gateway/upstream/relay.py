"""The faithful relay of one upstream response to the client, under its deadlines.

Bodies are relayed as they arrive (``iter_any``), so SSE streams reach the client chunk by chunk;
compressed bodies pass through untouched (``auto_decompress=False``). Once the first byte went to
the client, a failure can no longer be an HTTP error: an event stream ends with an SSE
``data: {"error": ...}`` event, any other body is cut (the connection closed, so that a truncated
body never looks complete).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Coroutine, Mapping, MutableMapping
from types import TracebackType
from typing import Any, NamedTuple, Protocol

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from ..errors import GatewayError, UpstreamError, UpstreamTimeoutError
from . import consumer
from .dispatch import Dispatch, Timeouts
from .failures import CLIENT_ERRORS
from .holders import PEEK_BYTES, id_of_response, id_of_stream
from .usage import BodyTail, StreamUsage, Usage, usage_in_body

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
# A non-streamed reply up to this size is read whole and sent in one write with its headers
# (a chat completion is a few KB); larger ones, and every stream, are relayed chunk by chunk.
SMALL_BODY_BYTES = 256 * 1024
# A whole reply this small (its head and body as the engine sent them) is sent as soon as it is
# read, before the attempt's and the request's bookkeeping (metrics, usage, spans): off the
# client's wait (one request at a time, ~15 µs of its latency). It is, only when the client's
# connection has nothing left to write: then it lies under the transport's high-water mark
# (64 KiB) once written, the gateway's own headers with it, its write never waits (no
# suspension, so no cancellation either) for a client that does not read, and nothing the
# request holds (a model's slot, a replica's lease, a key's) waits on that client.
SENT_AT_ONCE_BYTES = 32 * 1024
# Response headers the gateway's own server sets.
_NOT_RELAYED_DOWN = HOP_BY_HOP | {"content-length", "server", "date"}


class ReplyBody(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...

    def set_exception(self, exc: BaseException) -> None: ...


class UpstreamReply(Protocol):
    """What the relay reads of an upstream reply: the gateway's own client's
    :class:`gateway.upstream.http1.Reply` (aiohttp's ``ClientResponse`` names, and its head's size
    and its connection's loop besides)."""

    @property
    def status(self) -> int: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def head_bytes(self) -> int: ...  # the status line's and headers' size, at most

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...  # its connection's (get_running_loop() is a getpid)

    @property
    def content_type(self) -> str: ...

    @property
    def content(self) -> ReplyBody: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Relayed(NamedTuple):
    response: web.StreamResponse | None  # None: nothing was sent, ``error`` is the answer
    outcome: str  # for gateway_upstream_requests_total: ok, http_4xx, http_5xx, timeout, aborted
    upstream_failed: bool  # the replica broke off or went silent (counts against its health)
    error: GatewayError | None = None  # to raise once the attempt is counted
    response_id: str | None = None  # a stored response's id (the Responses API), learned from the reply
    usage: Usage | None = None  # the tokens a successful reply says it cost (gateway.upstream.usage)


def outcome_of(status: int) -> str:
    """The ``outcome`` label of an upstream answer with this status."""
    return "ok" if status < 400 else "http_4xx" if status < 500 else "http_5xx"


class RelayResponse(web.StreamResponse):
    """A relayed response; ``client_gone`` tells the metrics the client left before the end."""

    client_gone = False


class SentResponse(web.Response, RelayResponse):
    """A small reply relayed whole and sent at once (:func:`_relay_whole`)."""


def relay(
    request: web.Request, upstream: UpstreamReply, dispatch: Dispatch, deadline: float | None = None
) -> Coroutine[Any, Any, Relayed]:
    """Relay ``upstream`` to the client (the coroutine that does it); ``deadline`` (loop time)
    ends the exchange (``total``). A small non-streamed reply is read whole, any other relayed
    chunk by chunk. ``dispatch.reprime``: a reply that says vLLM's EC consumer missed a primed
    embedding (:mod:`gateway.upstream.consumer`: the status, the whole small body or a stream's
    opening) is not relayed; its error goes back to the attempt, which primes again."""
    outcome = outcome_of(upstream.status)
    length = upstream.content_length
    streamed = dispatch.timeouts.stream_idle is not None  # the client asked for a stream
    if not streamed and length is not None and length <= SMALL_BODY_BYTES:
        return _relay_whole(upstream, dispatch, deadline, outcome, request)
    return _relay_stream(request, upstream, dispatch, deadline, outcome)


async def _relay_stream(
    request: web.Request, upstream: UpstreamReply, dispatch: Dispatch, deadline: float | None, outcome: str
) -> Relayed:
    """A reply relayed chunk by chunk as it arrives (every stream, and a reply of unknown or large
    length), under the deadlines of :class:`_Deadlines`."""
    model, gateway_headers, timeouts = dispatch.model.name, dispatch.gateway_headers, dispatch.timeouts
    length = upstream.content_length
    first = b""
    if dispatch.reprime is not None:  # the stream's opening decides, before anything goes to the client
        missed = consumer.missed(model, upstream.status, b"")
        if missed is not None:
            return Relayed(None, outcome, False, missed)
        loop = asyncio.get_running_loop()
        wait = timeouts.read if deadline is None else min(timeouts.read, max(0.0, deadline - loop.time()))
        try:
            async with asyncio.timeout(wait):
                first = await consumer.opening(upstream.content.iter_any())
        except CLIENT_ERRORS as exc:
            log.warning("upstream of %s broke off before its first chunk: %r", model, exc)
            if isinstance(exc, TimeoutError):
                if deadline is not None and loop.time() >= deadline:
                    message = f"Upstream of model '{model}' did not finish within {timeouts.total:g}s"
                    return Relayed(None, "timeout", False, UpstreamTimeoutError(message))
                message = f"Upstream of model '{model}' sent no first chunk within {timeouts.read:g}s"
                return Relayed(None, "timeout", True, UpstreamTimeoutError(message))
            return Relayed(None, "aborted", True, UpstreamError(f"Upstream of model '{model}' broke off its response"))
        missed = consumer.missed(model, upstream.status, first)
        if missed is not None:
            return Relayed(None, outcome, False, missed)
    headers = _client_headers(upstream, gateway_headers)
    if dispatch.answer_headers:
        with_key_limits(headers, dispatch.answer_headers, upstream.status)
    response = RelayResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    if length is not None:
        response.content_length = length
    await response.prepare(request)
    loop = upstream.loop
    deadlines = _Deadlines(loop, request, upstream, timeouts, deadline)
    failed = False
    # a Responses stream: the id of the response it stores, from its response.created event
    learning = dispatch.api.stores and upstream.status == 200
    seen, response_id = first, None
    counting = upstream.status < 300
    usage: StreamUsage | BodyTail = StreamUsage() if upstream.content_type == "text/event-stream" else BodyTail()
    hidden = UsageHidden() if dispatch.hide_usage and upstream.content_type == "text/event-stream" else None
    try:
        if first:
            if counting:
                usage.feed(first)
            deadlines.writing_since = loop.time()
            await response.write(first if hidden is None else hidden.feed(first))
            deadlines.writing_since = None
            deadlines.waiting_since = loop.time()
        async for chunk in upstream.content.iter_any():
            deadlines.writing_since = loop.time()
            await response.write(chunk if hidden is None else hidden.feed(chunk))
            deadlines.writing_since = None
            deadlines.waiting_since = loop.time()
            if counting:
                usage.feed(chunk)
            if learning:
                seen += chunk
                response_id = id_of_stream(seen)
                learning = response_id is None and len(seen) < PEEK_BYTES
        if hidden is not None and hidden.rest:
            await response.write(hidden.rest)
        deadlines.writing_since = loop.time()
        await response.write_eof()  # within the deadline too: a full buffer waits here
    except ConnectionResetError:  # the client left: stop the engine's work by closing upstream
        upstream.close()
        response.client_gone = True
        outcome = "aborted"
    except CLIENT_ERRORS as exc:
        failed = deadlines.expired != "total"  # a generation longer than the model allows is no fault
        outcome = "timeout" if deadlines.expired else "aborted"
        log.warning("upstream of %s broke off mid-response: %r", model, exc)
        is_sse = upstream.content_type == "text/event-stream"
        if is_sse and "Content-Encoding" not in upstream.headers:  # an event can't go into a compressed stream
            deadlines.writing_since = loop.time()
            if dispatch.api.stores and response_id is None:
                response_id = id_of_stream(seen)
            error = _broken(model, deadlines, timeouts)
            event = dispatch.api.stream_error(error, response_id, dispatch.model.upstream_name)
            await _write_quietly(response, event)
        elif request.transport is not None:
            request.transport.close()  # a truncated body must not look complete
    finally:
        deadlines.cancel()
        if deadlines.client_stalled:
            log.warning("client took no bytes for %gs; dropped (model %s)", timeouts.client_write, model)
    return Relayed(response, outcome, failed, response_id=response_id, usage=usage.usage if counting else None)


async def _relay_whole(
    upstream: UpstreamReply, dispatch: Dispatch, deadline: float | None, outcome: str, request: web.Request
) -> Relayed:
    """A small reply of known length, read whole and sent with its headers in one write. Nothing
    reached the client before the body is complete, so a replica that breaks off is a clean 502
    (raised by the caller once the attempt is counted, rendered like every other error). One
    under SENT_AT_ONCE_BYTES is sent here, its key's headers with it; a larger one by aiohttp
    once the handler returns. (A stored response, whose id the attempt remembers, waits for it.)"""
    model, gateway_headers, timeouts = dispatch.model.name, dispatch.gateway_headers, dispatch.timeouts
    try:
        if deadline is None:
            body = await upstream.read()  # bounded by the socket's read timeout (first_byte_s)
        else:
            async with asyncio.timeout_at(deadline):
                body = await upstream.read()
    except CLIENT_ERRORS as exc:
        log.warning("upstream of %s broke off mid-response: %r", model, exc)
        expired = deadline is not None and asyncio.get_running_loop().time() >= deadline
        error_headers = dict(gateway_headers)
        if expired:
            error: GatewayError = UpstreamTimeoutError(
                f"Upstream of model '{model}' did not finish within {timeouts.total:g}s", headers=error_headers
            )
        elif isinstance(exc, TimeoutError):
            error = UpstreamTimeoutError(
                f"Upstream of model '{model}' sent no response within {timeouts.read:g}s", headers=error_headers
            )
        else:
            error = UpstreamError(f"Upstream of model '{model}' broke off its response", headers=error_headers)
        return Relayed(None, "timeout" if isinstance(error, UpstreamTimeoutError) else "aborted", not expired, error)
    if dispatch.reprime is not None:
        missed = consumer.missed(model, upstream.status, body)
        if missed is not None:
            return Relayed(None, outcome, False, missed)
    headers = _client_headers(upstream, gateway_headers)
    transport = request.transport
    if (len(body) + upstream.head_bytes > SENT_AT_ONCE_BYTES or dispatch.api.stores or transport is None
            or transport.get_write_buffer_size()):  # fmt: skip
        response: web.Response = web.Response(
            status=upstream.status, reason=upstream.reason, headers=headers, body=body
        )
    else:
        if dispatch.answer_headers:
            with_key_limits(headers, dispatch.answer_headers, upstream.status)
        sent = response = SentResponse(status=upstream.status, reason=upstream.reason, headers=headers, body=body)
        try:
            await sent.prepare(request)
            await sent.write_eof()
        except ConnectionError:  # the client left: counted as such (its reply was whole, its usage spent)
            sent.client_gone = True
            outcome = "aborted"
    usage = usage_in_body(body) if upstream.status < 300 else None
    if dispatch.api.stores and upstream.status == 200:  # the id of the response it stores
        return Relayed(response, outcome, False, response_id=id_of_response(body), usage=usage)
    return Relayed(response, outcome, False, usage=usage)


def _broken(model: str, deadlines: _Deadlines, timeouts: Timeouts) -> GatewayError:
    if deadlines.expired == "first_byte":
        return UpstreamTimeoutError(f"Upstream of model '{model}' sent no first chunk within {timeouts.read:g}s")
    if deadlines.expired == "idle":
        return UpstreamTimeoutError(f"Upstream of model '{model}' sent nothing for {timeouts.stream_idle:g}s")
    if deadlines.expired == "total":
        return UpstreamTimeoutError(f"Upstream of model '{model}' did not finish within {timeouts.total:g}s")
    return UpstreamError(f"Upstream of model '{model}' broke off the stream")


class _Deadlines:
    """The deadlines of a relayed response, kept by one timer rather than one per chunk.

    A write that has waited ``client_write`` seconds means a client that stopped reading: its
    connection is aborted, which ends the handler and so closes the upstream request (the engine
    stops). That watch goes on to the end, the error event included. A stream whose engine sent
    no first chunk within ``first_byte`` (queueing and prefill: ``timeouts.read``; a non-streamed
    body's silence is the socket's read timeout), or nothing for ``stream_idle`` seconds after a
    chunk, is hung, and an exchange past ``total_at`` (loop time) is over: the upstream read
    fails with a timeout, which the relay turns into an SSE error event (``expired`` says which).
    """

    __slots__ = ("_handle", "_loop", "_request", "_started", "_upstream", "client_stalled", "client_write",
                 "expired", "first_byte", "stream_idle", "total_at", "waiting_since", "writing_since")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request: web.Request,
        upstream: UpstreamReply,
        timeouts: Timeouts,
        total_at: float | None,
    ) -> None:
        self._loop, self._request, self._upstream = loop, request, upstream
        self.client_write, self.stream_idle = timeouts.client_write, timeouts.stream_idle
        self.first_byte = timeouts.read if timeouts.stream_idle is not None else None
        self.total_at = total_at
        self._started = loop.time()
        self.writing_since: float | None = None
        self.waiting_since: float | None = None  # None until the first chunk came
        self.client_stalled = False
        self.expired: str | None = None  # "first_byte", "idle" or "total"
        self._handle = loop.call_at(self._due(self._started), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        writing = self.writing_since
        if writing is not None and now - writing >= self.client_write:
            self.client_stalled = True
            if self._request.transport is not None:
                self._request.transport.abort()
            return
        if self.expired is None:
            waiting = self.waiting_since
            if self.total_at is not None and now >= self.total_at:
                self._expire("total")  # the next read fails, whatever the client is doing
            elif writing is None and waiting is None and self.first_byte is not None:
                if now - self._started >= self.first_byte:
                    self._expire("first_byte")
            elif writing is None and waiting is not None and self.stream_idle is not None:
                if now - waiting >= self.stream_idle:
                    self._expire("idle")
        self._handle = self._loop.call_at(self._due(now), self._check)

    def _due(self, now: float) -> float:
        total = self.total_at if self.expired is None and self.total_at is not None else math.inf
        if self.writing_since is not None:
            return min(self.writing_since + self.client_write, total)
        # a write or a chunk may start before the next due: look again within the shorter span
        dues = [now + min(self.client_write, self.stream_idle or self.client_write), total]
        if self.expired is None:
            if self.waiting_since is None and self.first_byte is not None:
                dues.append(self._started + self.first_byte)
            elif self.waiting_since is not None and self.stream_idle is not None:
                dues.append(self.waiting_since + self.stream_idle)
        return min(dues)

    def _expire(self, which: str) -> None:
        self.expired = which
        self._upstream.content.set_exception(aiohttp.ServerTimeoutError(f"stream {which}"))

    def cancel(self) -> None:
        self._handle.cancel()


class UsageHidden:
    """A chat or completions stream less its usage chunk (``"choices": []`` and a ``usage``): the
    one the gateway asked for on a key's behalf, not the client (``Dispatch.hide_usage``). Events
    pass whole, as they end (a blank line); what is left at the end is :attr:`rest`."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self.rest + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self.rest = data
            return b""
        self.rest = data[end + 2 :]
        events = data[: end + 2]
        if _USAGE not in events:
            return events
        return b"".join(e + b"\n\n" for e in events[:-2].split(b"\n\n") if not _usage_only(e))


_USAGE = b'"usage"'


def _usage_only(event: bytes) -> bool:
    if _USAGE not in event or not event.startswith(b"data:"):
        return False
    try:
        chunk = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and chunk.get("usage") is not None


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        pass


def with_key_limits(headers: MutableMapping[str, str], limits: Mapping[str, str], status: int) -> None:
    """A key's x-ratelimit-* on an answer to it: over any of the name on a reply (the client's
    limits are its key's, not whatever an engine's own say); on a refusal only where it has none
    (an engine's, or one of the key's limits, newer, says when to come back)."""
    if status < 400:
        headers.update(limits)
        return
    for name, value in limits.items():
        headers.setdefault(name, value)


def _client_headers(upstream: UpstreamReply, gateway_headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The upstream's headers for the client: a copy in C, less the few the gateway's server sets,
    plus the gateway's own (which win over an upstream's of the same name)."""
    headers = upstream.headers.copy()
    for name in _NOT_RELAYED_DOWN:
        if name in headers:
            del headers[name]
    headers.update(gateway_headers)
    return headers
