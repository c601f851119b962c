"""A reply of the upstream HTTP/1.1 client: its head, and its body as it comes, with the flow
control that keeps a slow client from costing unbounded memory."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import NamedTuple, Protocol

from multidict import CIMultiDictProxy

from .errors import Disconnected


class Carrier(Protocol):
    """What a reply needs of the connection it comes on (:class:`gateway.upstream.http1.connection._Connection`)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def done(self, keep_alive: bool) -> None: ...

    def abort(self) -> None: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...  # (asked once: get_running_loop() is a system call)


HIGH_WATER = 256 * 1024  # bytes of a reply buffered before reading pauses
# framing of a reply body
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NONE = 0, 1, 2, 3


class Head(NamedTuple):
    """A reply's status line and headers, and how large they were at most (the bytes read until
    they ended: a body's bytes of the same read too)."""

    status: int
    reason: str
    headers: CIMultiDictProxy[str]
    size: int


class Reply:
    """An upstream reply, its head read; the body comes through ``iter_any()`` or ``read()``.

    The attributes and methods the relay uses, under aiohttp's ``ClientResponse``'s names where
    it has them (``content`` is the reply itself), and the head's size and the connection's loop."""

    __slots__ = ("_buffered", "_chunks", "_conn", "_done", "_error", "_keep_alive", "_waiter", "_whole",
                 "content_length", "framing", "head_bytes", "headers", "paused", "reason", "status")  # fmt: skip

    def __init__(self, conn: Carrier, head: Head, framing: int, length: int | None, keep_alive: bool) -> None:
        self._conn = conn
        self.status, self.reason, self.headers, self.head_bytes = head
        self.framing = framing  # _LENGTH, _CHUNKED, _UNTIL_CLOSE or _NONE
        self.content_length = length
        self._keep_alive = keep_alive
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._whole = False  # read(): buffer it all, no pausing
        self.paused = False

    @property
    def content(self) -> Reply:
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """Its connection's loop (asked once by the connection: get_running_loop() is a system call)."""
        return self._conn.loop

    @property
    def content_type(self) -> str:
        """The media type, lower-cased, without parameters (as aiohttp's)."""
        value = self.headers.get("Content-Type")
        if not value:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    # fed by the connection (llhttp's callbacks)

    def append(self, data: bytes) -> None:
        if self._done or self._error is not None or not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        if self._buffered > HIGH_WATER and not self.paused and not self._whole:
            self.paused = True
            self._conn.pause()

    def finish(self) -> None:
        if self._done or self._error is not None:
            return
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
            self.finish()
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
            waiter = self._waiter = self._conn.loop.create_future()
            await waiter

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        if self.paused:
            self.paused = False
            self._conn.resume()
        while not self._done and self._error is None:
            waiter = self._waiter = self._conn.loop.create_future()
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
