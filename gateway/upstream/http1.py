"""The gateway's own HTTP/1.1 client for the upstream hop: one request in one write, replies parsed
with a few ``bytes`` operations, connections kept alive per replica.

aiohttp's ``ClientSession`` builds a request object, a response object, a timer context, a
connection wrapper and a payload writer for every request, and costs about 90 µs of CPU per
chat completion on the machines we measure (docs/benchmarks.md); what an upstream hop needs of
it is small, because the gateway talks to known engines (vLLM, SGLang: uvicorn) with requests it
built itself. This client does that much, on an :class:`asyncio.Protocol`:

- ``POST`` with ``Content-Length`` (head and body in one write; a body over 1 MiB goes as a second
  write, not copied into the head), to ``http://`` or ``https://`` replicas, IPv6 included;
- replies framed by ``Content-Length``, ``chunked`` (extensions and trailers read past) or the end
  of the connection; 1xx interim answers skipped; bodies passed on as they arrive, undecoded
  (``Content-Encoding`` is the client's business);
- keep-alive per replica, idle connections let go after :data:`KEEPALIVE_S` (engines close theirs
  after 5 s: a connection reused as the engine closes it would fail a POST), a connection the
  engine closed while idle never reused, and a reused connection that breaks before any byte of
  the reply tried once more on a fresh one (the engine closed it as we wrote);
- reading paused while more than :data:`HIGH_WATER` bytes wait for a slow client, so a large reply
  costs bounded memory; a silence longer than ``read_timeout`` fails the reply
  (:class:`ReadTimeout`), checked by one lazily re-armed timer rather than one per read;
- a reply not read to its end (the client left, a retried status) closes its connection, which
  tells the engine to stop.

What it does not do, because the upstream hop never needs it: redirects, cookies, proxies,
decompression, ``Expect: 100-continue``, upgrades, pipelining.

Errors are :class:`Http1Error`; :mod:`gateway.upstream.failures` reads them as it reads aiohttp's.
``server.upstream_client: aiohttp`` switches the hop back to aiohttp's client.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, cast
from urllib.parse import quote, urlsplit

from multidict import CIMultiDict, CIMultiDictProxy

KEEPALIVE_S = 4.0  # < the 5 s after which uvicorn (vLLM, SGLang) closes an idle connection
HIGH_WATER = 256 * 1024  # bytes of a reply buffered before reading pauses
MAX_HEAD_BYTES = 64 * 1024  # status line and headers of a reply
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions
MAX_TRAILERS = 64 * 1024
LARGE_BODY_BYTES = 1 << 20  # written after the head rather than copied into it
# A reused connection that ends with nothing received within this long of the request was closed
# by the engine as the request went (a FIN in flight): sent again on a fresh connection. Later,
# the engine may have been working on it (and died): that is a reset, for gateway.upstream.client's
# retry policy and budget.
STALE_WINDOW_S = 0.05
MAX_INTERIM = 16  # 1xx answers before the real one
_HEX = b"0123456789abcdefABCDEF"


class Http1Error(Exception):
    """A failed exchange; ``str()`` is for logs (addresses are never told to clients)."""


class ConnectError(Http1Error):
    """The replica could not be reached: nothing was sent."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectTimeout(ConnectError):
    pass


class ReadTimeout(Http1Error, TimeoutError):
    """The replica went silent for longer than the exchange allows (a TimeoutError, as aiohttp's)."""


class Disconnected(Http1Error):
    """The connection ended before the reply did."""


class ProtocolError(Http1Error):
    """What came back is not HTTP/1.1 the client can read."""


class UnsendableHeader(ValueError):
    """A header value holds a line break: the gateway's own fault (its config), never the replica's,
    so not an :class:`Http1Error` (no replica is blamed or tried again); the upstream client
    answers it 502."""


class Http1Client:
    """Keep-alive connections to upstream replicas, one pool per replica URL."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S) -> None:
        self._keepalive_s = keepalive_s
        self._origins: dict[str, _Origin] = {}
        self._ssl: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    def origin(self, url: str) -> _Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(self, url)
        return origin

    async def post(
        self,
        url: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        connect_timeout: float,
        head_timeout: float | None,
        read_timeout: float | None,
    ) -> Reply:
        """POST ``body`` to ``path`` (origin-form, with its query) of replica ``url``; the reply once
        its head came. ``head_timeout`` bounds the wait for the head, ``read_timeout`` every
        silence after it (None: no bound, the caller keeps its own deadlines)."""
        origin = self._origins.get(url) or self.origin(url)
        data = origin.request_head(path, headers, body)
        conn = origin.idle_connection()
        if conn is not None:
            try:
                return await conn.exchange(data, body, head_timeout, read_timeout)
            except Disconnected:
                if not conn.closed_as_sent():
                    raise
                # the engine closed the kept-alive connection as the request went: a fresh one
        conn = await origin.connect(connect_timeout)
        return await conn.exchange(data, body, head_timeout, read_timeout)

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def released(self) -> None:
        """A connection went back to a pool: make sure idle ones are let go in time."""
        if self._sweep is None and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self._keepalive_s, self._let_go)

    def _let_go(self) -> None:
        self._sweep = None
        now = asyncio.get_running_loop().time()
        left = False
        for origin in self._origins.values():
            left = origin.let_go(now - self._keepalive_s) or left
        if left:
            self.released()

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for origin in self._origins.values():
            origin.close()
        self._origins.clear()

    @property
    def keepalive_s(self) -> float:
        return self._keepalive_s


class _Origin:
    """One replica: where to connect, what its requests start with, its idle connections."""

    __slots__ = ("_client", "_head_start", "_host_line", "host", "idle", "live", "port", "prefix", "tls", "url")

    def __init__(self, client: Http1Client, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._client = client
        self.url = url
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=-._~")
        self._host_line = f"\r\nHost: {parts.netloc}\r\n"
        self.idle: list[_Connection] = []  # most recently used last
        self.live: set[_Connection] = set()

    def request_head(self, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        if "Content-Type" not in headers:
            lines += "Content-Type: application/json\r\n"
        head = f"POST {self.prefix}{path} HTTP/1.1{self._host_line}{lines}Content-Length: {len(body)}\r\n\r\n"
        # every header came through aiohttp's parser or the gateway's config; a CR or LF in one
        # would split it into a header of someone else's choosing
        lines_expected = len(headers) + 4 + ("Content-Type" not in headers)
        if head.count("\n") != lines_expected or head.count("\r") != lines_expected:
            raise UnsendableHeader("a header value holds a line break; not sent")
        return head.encode("utf-8", "surrogateescape")

    def idle_connection(self) -> _Connection | None:
        """The most recently used idle connection still open and within keep-alive, or None."""
        idle = self.idle
        if not idle:
            return None
        oldest = asyncio.get_running_loop().time() - self._client.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.last_used > oldest:
                return conn
            conn.close()
        return None

    async def connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self)
        try:
            async with asyncio.timeout(timeout):
                if self.tls:
                    ctx = self._client.ssl_context()
                    await loop.create_connection(lambda: conn, self.host, self.port, ssl=ctx, server_hostname=self.host)
                else:
                    await loop.create_connection(lambda: conn, self.host, self.port)
        except TimeoutError:
            conn.close()
            raise ConnectTimeout(f"connect to {self.host}:{self.port} timed out after {timeout:g}s") from None
        except ConnectionRefusedError as exc:
            raise ConnectError("connection refused", exc) from None
        except OSError as exc:  # unreachable, no such host, TLS handshake
            raise ConnectError(f"{type(exc).__name__}: {exc.strerror or exc}", exc) from None
        except BaseException:  # cancelled while connecting: nothing is left open
            conn.close()
            raise
        return conn

    def release(self, conn: _Connection) -> None:
        conn.last_used = asyncio.get_running_loop().time()
        self.idle.append(conn)
        self._client.released()

    def let_go(self, before: float) -> bool:
        """Close idle connections last used before ``before``; whether idle ones remain."""
        keep = []
        for conn in self.idle:
            if conn.closed or conn.last_used <= before:
                conn.close()
            else:
                keep.append(conn)
        self.idle[:] = keep
        return bool(keep)

    def close(self) -> None:
        for conn in list(self.live):
            conn.close()
        self.idle.clear()


# framing of a reply body
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NONE = 0, 1, 2, 3
# where the chunked decoder is
_SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the one exchange on it at a time."""

    __slots__ = ("_due", "_head", "_head_future", "_interim", "_limit", "_loop", "_origin", "_paused", "_read_at",
                 "_read_timeout", "_sent_at", "_timer", "closed", "last_used", "nothing_received", "reply",
                 "transport")  # fmt: skip

    def __init__(self, origin: _Origin) -> None:
        self._origin = origin
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = 0.0
        self.reply: Reply | None = None
        self._head = bytearray()
        self._head_future: asyncio.Future[Reply] | None = None
        self._interim = 0  # 1xx answers of this exchange
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
        if reply is not None:
            if self._limit is not None:
                self._read_at = self._loop.time()
            reply.feed(data)
        elif self._head_future is not None:
            self._feed_head(data)
        else:  # bytes nobody asked for: the connection can't be trusted with another request
            self.close()

    def eof_received(self) -> bool:
        if self.reply is not None:
            self.reply.eof()
        self.closed = True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self._origin.live.discard(self)
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
        future: asyncio.Future[Reply] = self._loop.create_future()
        self._head_future = future
        self._read_timeout = read_timeout
        if len(body) < LARGE_BODY_BYTES:
            transport.write(head + body)
        else:
            transport.write(head)
            transport.write(body)
        self._sent_at = self._loop.time()
        self._watch(head_timeout if head_timeout is not None else read_timeout)
        return self._await_head(future)

    def closed_as_sent(self) -> bool:
        """Whether this exchange's connection ended with nothing received so soon after the
        request went that the engine closed it as it went (see STALE_WINDOW_S)."""
        return self.nothing_received and self._loop.time() - self._sent_at <= STALE_WINDOW_S

    async def _await_head(self, future: asyncio.Future[Reply]) -> Reply:
        try:
            return await future
        except BaseException:  # a timeout, a broken connection, or the caller cancelled
            self.abort()
            raise

    def _feed_head(self, data: bytes) -> None:
        head = self._head
        head += data
        start = 0
        while True:
            end = head.find(b"\r\n\r\n", start)
            if end < 0:
                if len(head) > MAX_HEAD_BYTES:
                    self._fail_head(ProtocolError(f"reply head over {MAX_HEAD_BYTES} bytes"))
                return
            try:
                reply = _parse_head(bytes(head[:end]), self)
            except ProtocolError as exc:
                self._fail_head(exc)
                return
            if reply is not None:
                break
            # a 1xx interim answer: the real one follows (its wait still counts from the request)
            self._interim += 1
            if self._interim > MAX_INTERIM:
                self._fail_head(ProtocolError(f"over {MAX_INTERIM} interim answers"))
                return
            del head[: end + 4]
        rest = bytes(head[end + 4 :])
        head.clear()
        future = self._head_future
        self._head_future = None
        if future is None or future.done():  # the caller gave up (cancelled) as the reply came
            self.abort()
            return
        self.reply = reply
        self._watch(self._read_timeout)
        future.set_result(reply)
        reply.begin(rest)

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
        now = self._read_at = self._loop.time()
        if self._timer is not None and self._due > now + limit:  # a shorter limit than the armed one
            self._stop_timer()
        if self._timer is None:
            self._due = now + limit
            self._timer = self._loop.call_at(self._due, self._check_silence)

    def _check_silence(self) -> None:
        self._timer = None
        limit = self._limit
        if limit is None or self.closed:
            return
        now = self._loop.time()
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
        self._timer = self._loop.call_at(due, self._check_silence)

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
            self._read_at = self._loop.time()
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()


# a reply's status line and header lines (names tokens; values without control characters but
# HTAB), each ending in CRLF: anything else is refused, never relayed (aiohttp's server would
# refuse to write it, and drop the client's connection)
_HEAD = re.compile(
    rb"HTTP/1\.[01] [0-9]{3}(?: [\t\x20-\x7e\x80-\xff]*)?\r\n"
    rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*"
)


def _parse_head(raw: bytes, conn: _Connection) -> Reply | None:
    """The reply a head (without its blank line) begins, or None for a 1xx interim answer."""
    if _HEAD.fullmatch(raw + b"\r\n") is None:
        raise ProtocolError(f"not an HTTP/1.1 reply head: {raw[:80]!r}")
    text = raw.decode("utf-8", "replace")
    lines = text.split("\r\n")
    status_line = lines[0]
    version, _, rest = status_line.partition(" ")  # the pattern checked their form
    code, _, reason = rest.partition(" ")
    status = int(code)
    if status < 200:
        if status == 101:
            raise ProtocolError("the server switched protocols")
        return None
    fields = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields.append((name, value.strip(" \t")))
    headers = CIMultiDict(fields)
    keep_alive = version == "HTTP/1.1"
    connection = headers.get("Connection")
    if connection is not None:
        tokens = connection.lower()
        if "close" in tokens:
            keep_alive = False
        elif "keep-alive" in tokens:
            keep_alive = True
    length: int | None = None
    codings = headers.getall("Transfer-Encoding", None)
    coding = ",".join(codings) if codings else None  # fields of one name are one list (RFC 9110 5.3)
    if status in (204, 304):
        framing = _NONE
        length = 0
    elif coding is not None:
        if coding.lower().rsplit(",", 1)[-1].strip() == "chunked":
            framing = _CHUNKED
        else:  # another coding last: the body runs to the end of the connection
            framing = _UNTIL_CLOSE
            keep_alive = False
        if "Content-Length" in headers or version == "HTTP/1.0":  # the coding wins; not trusted again
            keep_alive = False
    elif "Content-Length" in headers:
        values = {v.strip() for v in headers.getall("Content-Length")}
        value = values.pop()
        if values or not value.isascii() or not value.isdigit() or len(value) > 18:
            raise ProtocolError("bad Content-Length")
        length = int(value)
        framing = _LENGTH
    else:
        framing = _UNTIL_CLOSE
        keep_alive = False
    return Reply(conn, status, reason, CIMultiDictProxy(headers), framing, length, keep_alive)


def _chunk_size(line: bytes) -> int:
    """The size a chunk-size line gives (extensions ignored), or -1 when it is not one."""
    if 0 < len(line) <= 15 and not line.strip(_HEX):  # the common case: hex digits alone
        return int(line, 16)
    size = line.partition(b";")[0].rstrip(b" \t")
    if not size or len(size) > 15 or size.strip(_HEX):
        return -1
    return int(size, 16)


class Reply:
    """An upstream reply, its head read; the body comes through ``iter_any()`` or ``read()``.

    The attributes and methods the relay uses of aiohttp's ``ClientResponse``, under the same
    names (``content`` is the reply itself), so that one relay serves both clients."""

    __slots__ = ("_buffered", "_chunk_left", "_chunks", "_conn", "_cstate", "_done", "_error", "_keep_alive",
                 "_left", "_line", "_trailer_bytes", "_waiter", "_whole", "content_length", "framing", "headers",
                 "paused", "reason", "status")  # fmt: skip

    def __init__(
        self,
        conn: _Connection,
        status: int,
        reason: str,
        headers: CIMultiDictProxy[str],
        framing: int,
        length: int | None,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.status = status
        self.reason = reason
        self.headers = headers
        self.framing = framing
        self.content_length = length
        self._keep_alive = keep_alive
        self._left = length or 0  # bytes of a Content-Length body still to come
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = framing == _NONE or (framing == _LENGTH and length == 0)
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._whole = False  # read(): buffer it all, no pausing
        self.paused = False
        self._cstate = _SIZE
        self._chunk_left = 0
        self._line = b""  # a partial chunk-size line, CRLF or trailer
        self._trailer_bytes = 0

    @property
    def content(self) -> Reply:
        return self

    @property
    def content_type(self) -> str:
        """The media type, lower-cased, without parameters (as aiohttp's)."""
        value = self.headers.get("Content-Type")
        if not value:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    # fed by the connection

    def begin(self, data: bytes) -> None:
        """The bytes that came with the head."""
        if self._done:  # no body (204, 304, Content-Length: 0)
            self._conn.done(self._keep_alive and not data)
        elif data:
            self.feed(data)

    def feed(self, data: bytes) -> None:
        if self._done or self._error is not None:
            if data:  # more than the framing said: the connection is out of step
                self._keep_alive = False
            return
        framing = self.framing
        if framing == _LENGTH:
            left = self._left
            if len(data) <= left:
                self._append(data)
                self._left = left - len(data)
            else:
                self._append(data[:left])
                self._left = 0
                self._keep_alive = False
            if self._left == 0:
                self._finish()
        elif framing == _CHUNKED:
            self._feed_chunked(data)
        elif framing == _UNTIL_CLOSE:
            self._append(data)
        else:
            self._finish()

    def _feed_chunked(self, data: bytes) -> None:
        """Decode what came of a chunked body; the decoded pieces are passed on together, once."""
        if self._line:
            data = self._line + data
            self._line = b""
        pos, end = 0, len(data)
        state, left = self._cstate, self._chunk_left
        pieces: list[bytes] = []
        error: str | None = None
        finished = False
        while pos < end:
            if state == _DATA:
                stop = pos + left
                if stop <= end:
                    pieces.append(data[pos:stop])
                    pos, left, state = stop, 0, _DATA_END
                else:
                    pieces.append(data[pos:] if pos else data)
                    left -= end - pos
                    pos = end
            elif state == _DATA_END:
                if end - pos < 2:
                    self._line = data[pos:]
                    break
                if data[pos] != 13 or data[pos + 1] != 10:
                    error = "no CRLF after chunk data"
                    break
                pos += 2
                state = _SIZE
            elif state == _SIZE:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        error = "chunk-size line too long"
                    else:
                        self._line = data[pos:]
                    break
                left = _chunk_size(data[pos:eol])
                if left < 0:
                    error = f"bad chunk size {data[pos:eol][:40]!r}"
                    break
                pos = eol + 2
                state = _DATA if left else _TRAILER
            else:  # _TRAILER: header lines after the last chunk, then a blank line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self._line = data[pos:]
                    if len(self._line) > MAX_TRAILERS:
                        error = "trailers too long"
                    break
                if eol == pos:
                    if eol + 2 < end:  # bytes after the end of the body
                        self._keep_alive = False
                    finished = True
                    break
                self._trailer_bytes += eol + 2 - pos
                if self._trailer_bytes > MAX_TRAILERS:
                    error = "trailers too long"
                    break
                pos = eol + 2
        self._cstate, self._chunk_left = state, left
        if pieces:
            self._extend(pieces)
        if error is not None:
            self._broken(error)
        elif finished:
            self._finish()

    def _broken(self, why: str) -> None:
        self.fail(ProtocolError(why))
        self._conn.abort()

    def _extend(self, pieces: list[bytes]) -> None:
        self._chunks += pieces
        self._buffered += sum(map(len, pieces))
        self._arrived()

    def _append(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        self._arrived()

    def _arrived(self) -> None:
        self._wake()
        if self._buffered > HIGH_WATER and not self.paused and not self._whole:
            self.paused = True
            self._conn.pause()

    def _finish(self) -> None:
        self._done = True
        self._wake()
        # the connection is free once the body is in; reading it out of the buffer needs no socket,
        # and this reply no longer touches it (done() resumes reading if this reply paused it)
        self.paused = False
        self._conn.done(self._keep_alive)

    def eof(self) -> None:
        if self._done:
            return
        if self.framing == _UNTIL_CLOSE:
            self._keep_alive = False
            self._finish()
        else:
            self.fail(Disconnected("the server closed the connection mid-body"))

    def fail(self, exc: BaseException) -> None:
        """End the body with ``exc`` (the relay's deadlines use it too, as ``set_exception``)."""
        if self._done or self._error is not None:
            return
        self._error = exc
        self._wake()

    set_exception = fail

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # read by the relay

    def iter_any(self) -> Reply:
        return self

    def __aiter__(self) -> Reply:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self.paused:
                    self.paused = False
                    self._conn.resume()
                return data
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            waiter = self._waiter = self._conn._loop.create_future()
            await waiter

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        if self.paused:
            self.paused = False
            self._conn.resume()
        while not self._done and self._error is None:
            waiter = self._waiter = self._conn._loop.create_future()
            await waiter
        if self._error is not None:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    def close(self) -> None:
        """Done with the reply: a body not read to its end ends the connection (the engine stops)."""
        if not self._done:
            self._done = True
            self._conn.abort()
        self._chunks.clear()

    async def __aenter__(self) -> Reply:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
