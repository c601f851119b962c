"""One connection to a replica: the request written, the reply parsed by llhttp (``httptools``),
keep-alive and the silence timer."""

from __future__ import annotations

import asyncio
import re
import select
from collections.abc import Coroutine
from typing import Any, Protocol, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from .errors import Disconnected, Http1Error, ProtocolError, ReadTimeout
from .reply import _CHUNKED, _LENGTH, _NONE, _UNTIL_CLOSE, Head, Reply


class Origin(Protocol):
    """What a connection needs of the pool it belongs to (:class:`gateway.upstream.http1.client._Origin`)."""

    idle: list[_Connection]  # given back, most recently used last
    live: set[_Connection]  # every open one

    def lost(self, conn: _Connection) -> None: ...

    def release(self, conn: _Connection) -> None: ...


MAX_HEAD_BYTES = 64 * 1024  # status line and headers of a reply
MAX_TRAILERS = 64 * 1024
MAX_CHUNK_LINE = 4 * 1024  # a chunk's size line with its extensions
MAX_INTERIM = 16  # 1xx answers before the real one
SPLICE_BYTES = 16 * 1024  # smaller bodies are copied behind their head: one buffer, one send
# A reused connection that ends with nothing received within this long of the request was closed
# by the engine as the request went (a FIN in flight): sent again on a fresh connection. Later,
# the engine may have been working on it (and died): that is a reset, for gateway.upstream.client's
# retry policy and budget.
STALE_WINDOW_S = 0.05


# a reason phrase: what aiohttp's server writes again (no control character but HTAB)
_REASON = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


class _Unasked(Exception):
    """Bytes after the reply's end: nobody asked for them."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the one exchange on it at a time; llhttp parses what comes
    back and calls the ``on_*`` methods."""

    __slots__ = ("_complete", "_due", "_fields", "_head_fed", "_head_future", "_interim", "_limit",
                 "_origin", "_parser", "_paused", "_read_at", "_read_timeout", "_reason", "_sent_at",
                 "_since_body", "_timer", "_trailer_bytes", "closed", "last_used", "loop", "nothing_received",
                 "reply", "transport")  # fmt: skip

    def __init__(self, origin: Origin) -> None:
        self._origin = origin
        self.loop = asyncio.get_running_loop()  # (its replies' waits and timers: asked once, a system call)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = 0.0
        self.reply: Reply | None = None
        self._parser = httptools.HttpResponseParser(self)
        # RFC 9112's chunk-ext allows whitespace between a chunk's size and its ';' (BWS): llhttp's
        # one leniency here, and one that changes no framing
        self._parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)
        self._head_future: asyncio.Future[Reply] | None = None
        self._head_fed = 0  # bytes fed since the head began
        self._fields: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._interim = 0  # 1xx answers of this exchange
        self._complete = False  # this exchange's reply came to its end
        self._trailer_bytes = 0
        self._since_body = 0  # bytes of the reply since its body last came (chunk lines, trailers)
        self.nothing_received = True  # in this exchange
        self._sent_at = 0.0
        self._paused = False  # reading paused (a slow client)
        self._limit: float | None = None  # the longest silence allowed now
        self._read_timeout: float | None = None  # the longest silence once the head came
        self._read_at = 0.0  # when body bytes last came (the head's wait counts from the request)
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the timer fires

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        self._origin.live.add(self)

    def data_received(self, data: bytes) -> None:
        self.nothing_received = False
        reply = self.reply
        if reply is None:
            if self._head_future is None:  # bytes nobody asked for: the connection can't be trusted
                self.close()
                return
            self._head_fed += len(data)
        else:
            if self._limit is not None:
                self._read_at = self.loop.time()
            self._since_body += len(data)  # a chunk's size line or trailers, unless a body callback resets it
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, BaseException) and not isinstance(cause, Exception):
                raise cause from None  # KeyboardInterrupt, SystemExit: not the replica's
            self._refused(cause if isinstance(cause, Http1Error | _Unasked) else ProtocolError(str(cause or exc)))
            return
        except httptools.HttpParserUpgrade:
            self._refused(ProtocolError("the server switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._refused(ProtocolError(f"not an HTTP/1.1 reply: {exc}"))
            return
        if self.reply is None:
            if self._head_future is not None and self._head_fed > MAX_HEAD_BYTES:
                self._fail_head(ProtocolError(f"reply head over {MAX_HEAD_BYTES} bytes"))
        elif self._since_body > MAX_TRAILERS + MAX_CHUNK_LINE:  # llhttp holds a partial trailer whole
            self._refused(ProtocolError("a chunk-size line or trailers too long"))

    def eof_received(self) -> bool:
        if self.reply is not None:
            self.reply.eof()
        self.closed = True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self._origin.lost(self)
        error = Disconnected(f"connection lost: {exc!r}" if exc else "the server closed the connection")
        future = self._head_future
        if future is not None and not future.done():
            future.set_exception(error)
        if self.reply is not None:
            self.reply.fail(error)

    def pause_writing(self) -> None:  # a large body waits in the transport's buffer: fine, it is in memory
        pass

    def resume_writing(self) -> None:
        pass

    # llhttp's callbacks (an exception raised here ends the parse: data_received reads it)

    def on_message_begin(self) -> None:
        if self._complete:  # a second reply to one request
            raise _Unasked
        self._fields = []
        self._reason = b""

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reply is None:
            self._fields.append((name, value))
            return
        # a trailer, read past: whole fields counted here (those of one read), a field still
        # coming by data_received (a partial one llhttp holds)
        self._trailer_bytes += len(name) + len(value) + 4
        if self._trailer_bytes > MAX_TRAILERS:
            raise ProtocolError("trailers too long")

    def on_headers_complete(self) -> None:
        parser = self._parser
        if self._head_fed > MAX_HEAD_BYTES and _head_size(self._reason, self._fields) > MAX_HEAD_BYTES:
            raise ProtocolError(f"reply head over {MAX_HEAD_BYTES} bytes")  # its end came in the same read
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise ProtocolError(f"HTTP/{parser.get_http_version()} is not HTTP/1.1")
        status = parser.get_status_code()
        if not 100 <= status <= 599:
            raise ProtocolError(f"status {status} is no HTTP status")
        if _REASON.fullmatch(self._reason) is None:
            raise ProtocolError(f"a control character in the reason phrase: {self._reason[:80]!r}")
        if status < 200:  # an interim answer: the real one follows (its wait still counts from the request)
            if status == 101:
                raise ProtocolError("the server switched protocols")
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise ProtocolError(f"over {MAX_INTERIM} interim answers")
            return
        reply = _reply(self, status, self._reason, self._fields, parser.should_keep_alive(), self._head_fed)
        future = self._head_future
        self._head_future = None
        if future is None or future.done():  # the caller gave up (cancelled) as the reply came
            self.abort()
            raise _Unasked
        self.reply = reply
        self._trailer_bytes = 0
        self._since_body = 0
        self._watch(self._read_timeout)
        future.set_result(reply)

    def on_body(self, body: bytes) -> None:
        if self.reply is not None:
            self._since_body = 0
            self.reply.append(body)

    def on_message_complete(self) -> None:
        reply = self.reply
        if reply is None:  # the end of an interim answer (its bytes count against the head's bound too)
            return
        self._complete = True
        reply.finish()

    # the exchange

    def exchange(
        self, head: bytes, body: bytes, head_timeout: float | None, read_timeout: float | None
    ) -> Coroutine[Any, Any, Reply]:
        """Send the request; the awaitable of the reply's head."""
        self.nothing_received = True
        transport = self.transport
        if transport is None or self.closed:
            raise Disconnected("connection closed")
        self.reply = None
        self._interim = 0
        self._head_fed = 0
        self._complete = False
        future: asyncio.Future[Reply] = self.loop.create_future()
        self._head_future = future
        self._read_timeout = read_timeout
        if len(body) < SPLICE_BYTES:
            transport.write(head + body)
        else:  # one writev of both, not a copy of the body behind its head
            transport.writelines((head, body))
        self._sent_at = self.loop.time()
        self._watch(head_timeout if head_timeout is not None else read_timeout)
        return self._await_head(future)

    def quiet(self) -> bool:
        """Whether nothing waits to be read on this idle connection: bytes the engine sent after a
        reply, not yet read by the loop, would answer the next request (an EOF would break it)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:  # not a socket (a test's transport)
            return True
        try:
            poll = select.poll()  # not select(): it refuses descriptors past 1023
            poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            return not poll.poll(0)  # readable, hung up or in error: not to be reused
        except (OSError, ValueError):
            return False

    def closed_as_sent(self) -> bool:
        """Whether this exchange's connection ended with nothing received so soon after the
        request went that the engine closed it as it went (see STALE_WINDOW_S)."""
        return self.nothing_received and self.loop.time() - self._sent_at <= STALE_WINDOW_S

    async def _await_head(self, future: asyncio.Future[Reply]) -> Reply:
        try:
            return await future
        except BaseException:  # a timeout, a broken connection, or the caller cancelled
            self.abort()
            raise

    def _refused(self, error: Http1Error | _Unasked) -> None:
        """llhttp refused what came, or a callback did."""
        if self._complete or isinstance(error, _Unasked):  # after the reply's end: untrusted from here on
            self.close()
            if self in self._origin.idle:  # given back as the reply ended, in this same read
                self._origin.idle.remove(self)
        elif self.reply is None:
            self._fail_head(error)
        else:
            self.reply.fail(error)
            self.abort()

    def _fail_head(self, exc: Http1Error) -> None:
        future = self._head_future
        self._head_future = None
        self.abort()
        if future is not None and not future.done():
            future.set_exception(exc)

    # the silence timer: one handle, re-armed when it fires rather than at every read

    def _watch(self, limit: float | None) -> None:
        self._limit = limit
        if limit is None:
            self._stop_timer()
            return
        now = self._read_at = self.loop.time()
        if self._timer is not None and self._due > now + limit:  # a shorter limit than the armed one
            self._stop_timer()
        if self._timer is None:
            self._due = now + limit
            self._timer = self.loop.call_at(self._due, self._check_silence)

    def _check_silence(self) -> None:
        self._timer = None
        limit = self._limit
        if limit is None or self.closed:
            return
        now = self.loop.time()
        due = self._read_at + limit
        if self._paused:  # waiting for the client, not the replica
            self._read_at = now
            due = now + limit
        elif now >= due:
            error = ReadTimeout(f"no bytes for {limit:g}s")
            reply = self.reply
            if reply is None:
                self._fail_head(error)
            else:
                reply.fail(error)
                self.abort()
            return
        self._due = due
        self._timer = self.loop.call_at(due, self._check_silence)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # the end of an exchange

    def done(self, reusable: bool) -> None:
        """The reply came to its end (its body may still wait in the reply's buffer)."""
        self._limit = None
        self._stop_timer()
        self.reply = None
        if self._paused:  # the next exchange reads from the start
            self.resume()
        if reusable and not self.closed:
            self._origin.release(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """End the connection now, unsent bytes dropped: the engine sees the client leave."""
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if self.transport is not None and not self.closed and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._read_at = self.loop.time()
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()


def _head_size(reason: bytes, fields: list[tuple[bytes, bytes]]) -> int:
    return 17 + len(reason) + sum(len(name) + len(value) + 4 for name, value in fields)


def _reply(
    conn: _Connection, status: int, reason: bytes, fields: list[tuple[bytes, bytes]], keep_alive: bool, fed: int
) -> Reply:
    """The reply a head begins, its framing as llhttp read it: Content-Length, chunked, or the
    end of the connection. Any Transfer-Encoding but a single chunked is refused: relayed, gzip
    bytes would reach the client as if they were the body, a second chunked its framing. ``fed``:
    the bytes read until the head ended (its size at most)."""
    headers = CIMultiDict([(name.decode("latin-1"), value.decode("utf-8", "replace")) for name, value in fields])
    codings = headers.getall("Transfer-Encoding", None)
    length: int | None = None
    if status in (204, 304):
        framing, length = _NONE, 0
    elif codings is not None:
        coding = ",".join(codings)  # fields of one name are one list (RFC 9110 5.3)
        if coding.strip(" \t").lower() != "chunked":
            raise ProtocolError(f"Transfer-Encoding {coding[:40]!r}: only chunked is read")
        framing = _CHUNKED
    elif "Content-Length" in headers:  # llhttp checked it: digits, once
        framing, length = _LENGTH, int(headers["Content-Length"])
    else:
        framing, keep_alive = _UNTIL_CLOSE, False
    text = reason.decode("utf-8", "replace")
    return Reply(conn, Head(status, text, CIMultiDictProxy(headers), fed), framing, length, keep_alive)
