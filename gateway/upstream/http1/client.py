"""The client and its pools: one per replica URL, of keep-alive connections, bounded in number."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import quote, urlsplit

from ..wire import KEEPALIVE_S
from .connection import _Connection
from .errors import ConnectError, ConnectTimeout, Disconnected, PoolFull, UnsendableHeader
from .reply import Reply

MAX_CONNECTIONS = 1024  # open to one replica (a request holds one while it is relayed)


class Waits(NamedTuple):
    """How long one request waits on its replica (None: no bound, the caller keeps its own deadlines)."""

    connect: float  # for a connection (or a place among MAX_CONNECTIONS)
    head: float | None  # for the reply's head; None: ``read`` bounds it
    read: float | None  # every silence once the head came


class Http1Client:
    """Keep-alive connections to upstream replicas, one pool per replica URL."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S, max_connections: int | None = None) -> None:
        self._keepalive_s = keepalive_s
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
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
        waits: Waits,
    ) -> Reply:
        """POST ``body`` to ``path`` (origin-form, with its query) of replica ``url``; the reply once
        its head came, within ``waits``."""
        connect_timeout, head_timeout, read_timeout = waits
        origin = self._origins.get(url) or self.origin(url)
        data = origin.request_head(path, headers, body)
        conn = origin.idle_connection()
        if conn is None and not origin.has_room():
            conn = await origin.take_when_free(connect_timeout)  # a connection given back, or room for one
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
        now = asyncio.get_running_loop().time()  # (a timer's: off the requests' path)
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
    """One replica: where to connect, what its requests start with, its idle connections, and the
    requests waiting for room under :data:`MAX_CONNECTIONS`."""

    __slots__ = ("_client", "_host_line", "host", "idle", "live", "opening", "port", "prefix", "tls", "url", "waiting")

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
        self.opening = 0  # connections being opened: they count against MAX_CONNECTIONS already
        self.waiting: deque[asyncio.Future[_Connection | None]] = deque()

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
        """The most recently used idle connection still open, within keep-alive and holding no
        bytes nobody asked for, or None."""
        idle = self.idle
        if not idle:
            return None
        # the connections' loop, asked once each (get_running_loop() is a getpid system call in
        # CPython 3.11): its clock is the one the sweep's timer runs on
        oldest = idle[-1].loop.time() - self._client.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.last_used > oldest and conn.quiet():
                return conn
            conn.close()
        return None

    def has_room(self) -> bool:
        """Whether a connection may open now: under MAX_CONNECTIONS, and nobody waits before."""
        return not self.waiting and len(self.live) + self.opening < self._client.max_connections

    async def connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self)
        self.opening += 1
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
        finally:
            self.opening -= 1
            if conn.transport is None:  # it never opened: its room is another's
                self._wake()
        return conn

    async def take_when_free(self, timeout: float) -> _Connection | None:
        """With MAX_CONNECTIONS open (or requests waiting before this one): a connection given
        back, or None once there is room to open one, within ``timeout``; past it, PoolFull,
        nothing sent. A connection handed over as the wait ends (a timeout, a cancel) goes on to
        the next in line, and so does room."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            waiter: asyncio.Future[_Connection | None] = loop.create_future()
            self.waiting.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    conn = await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():  # handed over just as it gave up
                    handed = waiter.result()
                    if handed is not None:
                        self.release(handed)
                    else:
                        self._wake()
                if isinstance(exc, TimeoutError):
                    raise PoolFull(
                        f"{len(self.live)} connections to {self.host}:{self.port} open and busy for {timeout:g}s"
                    ) from None
                raise
            finally:
                if not waiter.done():
                    waiter.cancel()
                    if waiter in self.waiting:
                        self.waiting.remove(waiter)
            if conn is None:
                if len(self.live) + self.opening < self._client.max_connections:
                    return None  # room: the caller opens a connection
                continue  # taken by another before this one ran: wait again
            if not conn.closed:  # a connection closed since it was handed over: wait again
                return conn

    def release(self, conn: _Connection) -> None:
        conn.last_used = conn.loop.time()
        while self.waiting:  # a request waiting for room takes it at once
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self.idle.append(conn)
        self._client.released()

    def lost(self, conn: _Connection) -> None:
        """A connection ended: room for another, for a request waiting for it."""
        self.live.discard(conn)
        self._wake()

    def _wake(self) -> None:
        """Room for one more connection: the first request waiting for it is told."""
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

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
