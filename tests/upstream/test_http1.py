"""The gateway's own HTTP/1.1 upstream client: framing, keep-alive, timeouts, flow control, failures.

Two kinds of test. Parser tests feed crafted reply bytes to a connection, split at every offset,
through a transport that records what the client writes (the bytes a socket would carry; no
network needed to say how a reply is read). Connection tests run a real loopback server that
answers each request with scripted bytes and counts the connections it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.upstream import http1
from gateway.upstream.failures import failure_of
from gateway.upstream.http1 import Http1Client, Reply

pytestmark = pytest.mark.timeout(30)

CHAT = b'{"model": "m", "messages": []}'


class Sink(asyncio.Transport):
    """What a socket would carry, recorded; reading paused or not."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_paused(self) -> bool:
        return self.paused


def connection(client: Http1Client) -> tuple[http1._Connection, Sink]:
    conn = http1._Connection(client.origin("http://127.0.0.1:9"))
    sink = Sink()
    conn.connection_made(sink)
    return conn, sink


async def answer(pieces: list[bytes], *, eof: bool = False) -> tuple[Reply, bytes, http1._Connection]:
    """The reply to one request, its bytes fed in ``pieces``; the reply, its whole body, the connection."""
    client = Http1Client()
    conn, _ = connection(client)
    origin = client.origin("http://127.0.0.1:9")
    waiting = asyncio.ensure_future(conn.exchange(origin.request_head("/v1/x", {}, CHAT), CHAT, None, None))
    for piece in pieces:
        conn.data_received(piece)
    if eof:
        conn.eof_received()
        conn.connection_lost(None)
    reply = await waiting
    return reply, await reply.read(), conn


def splits(data: bytes) -> list[list[bytes]]:
    """``data`` whole, byte by byte, and cut in two at every offset."""
    return [[data], [data[i : i + 1] for i in range(len(data))]] + [[data[:i], data[i:]] for i in range(1, len(data))]


CHUNKED = (
    b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n"
    b"X-Engine: vllm\r\n\r\n"
    b"6;name=value\r\ndata: \r\n"
    b"A \t;ext\r\n0123456789\r\n"
    b"1\r\n\n\r\n"
    b"0\r\nX-Trailer: 1\r\n\r\n"
)


@pytest.mark.parametrize("pieces", splits(CHUNKED), ids=lambda p: f"{len(p)}-pieces-{len(p[0])}")
async def test_a_chunked_reply_reads_the_same_however_it_is_cut(pieces: list[bytes]) -> None:
    reply, body, conn = await answer(pieces)
    assert (reply.status, reply.reason) == (200, "OK")
    assert reply.content_type == "text/event-stream"
    assert reply.headers["x-engine"] == "vllm"
    assert reply.content_length is None
    assert body == b"data: 0123456789\n"
    assert conn._origin.idle == [conn]  # read to its end: kept alive


LENGTH = b'HTTP/1.1 201 Created\r\nContent-Length: 11\r\nContent-Type: application/json\r\n\r\n{"id": "x"}'


@pytest.mark.parametrize("pieces", splits(LENGTH), ids=lambda p: f"{len(p)}-pieces-{len(p[0])}")
async def test_a_content_length_reply_reads_the_same_however_it_is_cut(pieces: list[bytes]) -> None:
    reply, body, conn = await answer(pieces)
    assert (reply.status, reply.content_length, body) == (201, 11, b'{"id": "x"}')
    assert conn._origin.idle == [conn]


@pytest.mark.parametrize(
    ("data", "eof", "body", "kept"),
    [
        (b"HTTP/1.1 204 No Content\r\n\r\n", False, b"", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", False, b"", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False, b"ok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False, b"ok", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", False, b"ok", True),
        (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", True, b"until the end", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok and more", False, b"ok", False),  # out of step
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx", False,
         b"ok", False),  # a second reply to one request
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=1\r\nok\r\n0\r\nX-T: 1\r\n\r\n", False,
         b"ok", True),  # chunk extensions and trailers read past
    ],
)  # fmt: skip
async def test_each_framing_ends_the_body_where_it_says(data: bytes, eof: bool, body: bytes, kept: bool) -> None:
    _, read, conn = await answer([data], eof=eof)
    assert read == body
    assert (conn._origin.idle == [conn]) is kept


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nNo colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: 1\nX-B: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX A: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0x2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (http1.MAX_HEAD_BYTES + 1),
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (http1.MAX_HEAD_BYTES + 1) + b"\r\n\r\n",  # with its end in the read
        b"HTTP/1.1 099 Early\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",  # not an interim answer
        b"HTTP/1.1 600 Beyond\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 999 Beyond\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",  # bare LF: refused at once, not waited on
        b"HTTP/1.1 200 O\x01K\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b",  # relayed, gzip bytes unlabelled
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",  # inner framing
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    ],
)
async def test_a_head_that_is_not_http11_fails_the_exchange(data: bytes) -> None:
    client = Http1Client()
    conn, sink = connection(client)
    waiting = conn.exchange(client.origin("http://127.0.0.1:9").request_head("/", {}, CHAT), CHAT, None, None)
    conn.data_received(data)
    with pytest.raises(http1.ProtocolError) as caught:
        await waiting
    assert sink.closed
    assert failure_of(caught.value).kind == "protocol"


@pytest.mark.parametrize(
    "chunks",
    [b"0x2\r\nok\r\n0\r\n\r\n", b"-2\r\nok\r\n0\r\n\r\n", b"zz\r\nok\r\n0\r\n\r\n", b"\r\nok\r\n", b"2\r\nokXX",
     b"1" * 1026, b"2\r\nok\r\n0\r\n" + b"X: y\r\n" * 20000],
)  # fmt: skip
async def test_a_broken_chunked_body_fails_the_read_and_the_connection(chunks: bytes) -> None:
    client = Http1Client()
    conn, sink = connection(client)
    waiting = conn.exchange(client.origin("http://127.0.0.1:9").request_head("/", {}, CHAT), CHAT, None, None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
    reply = await waiting
    with pytest.raises(http1.ProtocolError):
        await reply.read()
    assert sink.closed


async def test_a_body_cut_short_is_disconnected_not_complete() -> None:
    client = Http1Client()
    conn, _ = connection(client)
    waiting = conn.exchange(client.origin("http://127.0.0.1:9").request_head("/", {}, CHAT), CHAT, None, None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
    reply = await waiting
    conn.eof_received()
    conn.connection_lost(None)
    chunks = [chunk async for chunk in _until_error(reply)]
    assert chunks == [b"half", "Disconnected"]


async def _until_error(reply: Reply) -> AsyncIterator[Any]:
    try:
        async for chunk in reply.iter_any():
            yield chunk
    except http1.Http1Error as exc:
        yield type(exc).__name__


async def test_the_request_is_one_write_with_the_clients_headers_and_no_others() -> None:
    client = Http1Client()
    conn, sink = connection(client)
    origin = client.origin("http://[::1]:8000/prefix/")
    head = origin.request_head("/v1/chat/completions?x=1", {"Authorization": "Bearer k", "X-Request-Id": "r"}, CHAT)
    waiting = conn.exchange(head, CHAT, None, None)
    assert bytes(sink.written) == (
        b"POST /prefix/v1/chat/completions?x=1 HTTP/1.1\r\nHost: [::1]:8000\r\nAuthorization: Bearer k\r\n"
        b"X-Request-Id: r\r\nContent-Type: application/json\r\nContent-Length: 30\r\n\r\n" + CHAT
    )
    conn.connection_lost(None)
    with pytest.raises(http1.Disconnected):
        await waiting


@pytest.mark.parametrize("value", ["a\r\nEvil: 1", "a\nEvil: 1", "a\rb"])
def test_a_header_value_with_a_line_break_is_never_sent(value: str) -> None:
    origin = Http1Client().origin("http://127.0.0.1:9")
    with pytest.raises(http1.UnsendableHeader):  # the gateway's config at fault, not the replica: no Http1Error
        origin.request_head("/", {"X-Model-Key": value}, CHAT)


async def test_reading_pauses_while_a_slow_consumer_holds_the_high_water_mark() -> None:
    client = Http1Client()
    conn, sink = connection(client)
    waiting = conn.exchange(client.origin("http://127.0.0.1:9").request_head("/", {}, CHAT), CHAT, None, None)
    size = 4 * http1.HIGH_WATER
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
    reply = await waiting
    piece = b"x" * 65536
    for _ in range(http1.HIGH_WATER // len(piece) + 1):
        conn.data_received(piece)
    assert sink.is_paused()  # the socket is not read while the client is behind
    received = await reply.iter_any().__anext__()
    assert not sink.is_paused()
    left = size - len(piece) * (http1.HIGH_WATER // len(piece) + 1)
    conn.data_received(b"y" * left)
    rest = await reply.read()
    assert len(received) + len(rest) == size


# Real connections to a loopback server


@dataclass
class Script:
    """A loopback HTTP/1.1 server: each request (on whatever connection) is answered by the next
    ``answers`` function with the writer; it may write anything, or close."""

    answers: list[Callable[[asyncio.StreamWriter], Awaitable[None]]]
    connections: int = 0
    requests: list[tuple[int, bytes]] = field(default_factory=list)  # (connection, head)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a connection ended
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                self.requests.append((number, head))
                await self.answers.pop(0)(writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()
            self.closed.set()


@contextlib.asynccontextmanager
async def script(*answers: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> AsyncIterator[Script]:
    s = Script(list(answers))
    server = await asyncio.start_server(s.serve, "127.0.0.1", 0)
    s.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield s
    finally:
        server.close()
        # a test's client may still hold a connection: don't wait for it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):
                await server.wait_closed()


def ok(body: bytes = b'{"ok": true}') -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: application/json\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()

    return write


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()


def post(client: Http1Client, url: str, **timeouts: float | None) -> Coroutine[Any, Any, Reply]:
    options: dict[str, Any] = {"connect": 30.0, "head": None, "read": 30.0} | timeouts  # no busy machine outlasts
    return client.post(url, "/v1/chat/completions", {}, CHAT, http1.Waits(**options))


@pytest.fixture
async def client() -> AsyncIterator[Http1Client]:
    c = Http1Client()
    yield c
    await c.close()


async def test_connections_are_kept_alive_and_reused(client: Http1Client) -> None:
    async with script(ok(), ok(), ok()) as s:
        for _ in range(3):
            async with await post(client, s.url) as reply:
                assert await reply.read() == b'{"ok": true}'
        assert s.connections == 1
        assert [n for n, _ in s.requests] == [1, 1, 1]


async def test_a_kept_alive_connection_the_server_closed_as_it_was_reused_costs_no_request(client, monkeypatch) -> None:
    # the hang-up comes as the request goes; on a busy machine it may be seen a while later: a
    # window that no loaded machine outlasts (the test is of what happens inside it)
    monkeypatch.setattr(http1.connection, "STALE_WINDOW_S", 60.0)
    async with script(ok(), hang_up, ok(b"second")) as s:
        async with await post(client, s.url) as reply:
            await reply.read()
        async with await post(client, s.url) as reply:  # the idle connection dies as it is reused
            assert await reply.read() == b"second"
        assert s.connections == 2


async def test_a_fresh_connection_that_breaks_before_the_reply_is_a_reset(client: Http1Client) -> None:
    async with script(hang_up) as s:
        with pytest.raises(http1.Disconnected) as caught:
            await post(client, s.url)
        assert failure_of(caught.value).kind == "reset"
        assert s.connections == 1  # not tried again: the engine may have taken it


async def test_a_connection_the_server_closes_while_idle_is_not_reused(client: Http1Client) -> None:
    async def then_close(writer: asyncio.StreamWriter) -> None:
        await ok()(writer)
        writer.close()

    async with script(then_close, ok()) as s:
        async with await post(client, s.url) as reply:
            await reply.read()
        await s.closed.wait()
        async with await post(client, s.url) as reply:
            await reply.read()
        assert s.connections == 2


async def test_idle_connections_are_let_go_after_keepalive() -> None:
    client = Http1Client(keepalive_s=0.05)
    async with script(ok()) as s:
        async with await post(client, s.url) as reply:
            await reply.read()
        await s.closed.wait()  # the client closed it, not the server
        assert not client.origin(s.url).idle
    await client.close()


async def test_a_silent_replica_is_a_read_timeout_and_its_connection_closed(client: Http1Client) -> None:
    async def silent(writer: asyncio.StreamWriter) -> None:
        pass

    async with script(silent) as s:
        with pytest.raises(http1.ReadTimeout) as caught:
            await post(client, s.url, head=0.05)
        assert failure_of(caught.value).kind == "timeout"
        await s.closed.wait()  # the engine sees the client leave


async def test_a_body_that_stops_coming_is_a_read_timeout(client: Http1Client) -> None:
    async def stalls(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()

    async with script(stalls) as s:
        reply = await post(client, s.url, read=0.05)
        with pytest.raises(http1.ReadTimeout):
            await reply.read()
        await s.closed.wait()


async def test_a_caller_that_gives_up_closes_the_connection(client: Http1Client) -> None:
    async def silent(writer: asyncio.StreamWriter) -> None:
        pass

    async with script(silent) as s:
        task = asyncio.create_task(post(client, s.url))
        while not s.requests:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await s.closed.wait()


async def test_a_reply_left_unread_closes_its_connection(client: Http1Client) -> None:
    async def partly(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nbusy")
        await writer.drain()

    async with script(partly, ok()) as s:
        reply = await post(client, s.url)
        reply.close()  # e.g. a 503 retried elsewhere
        await s.closed.wait()
        async with await post(client, s.url) as second:
            await second.read()
        assert s.connections == 2


async def test_a_refused_connection_is_a_connect_failure(client: Http1Client) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(http1.ConnectError) as caught:
        await post(client, f"http://127.0.0.1:{port}")
    assert (failure_of(caught.value).kind, failure_of(caught.value).reason) == ("connect", "connection refused")


async def test_a_streamed_reply_arrives_chunk_by_chunk(client: Http1Client) -> None:
    next_chunk = asyncio.Event()

    async def events(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await next_chunk.wait()
            next_chunk.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with script(events) as s:
        seen = []
        async with await post(client, s.url, read=None) as reply:
            async for chunk in reply.content.iter_any():
                seen.append(chunk)  # each came before the next was written
                next_chunk.set()
        assert seen == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        assert client.origin(s.url).idle  # kept alive after a stream read to its end


def test_the_client_runs_on_uvloop_as_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """`modality-gateway serve` runs on uvloop, whose transports are not asyncio's classes."""
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.setattr(http1.connection, "STALE_WINDOW_S", 60.0)  # as above: the hang-up is seen as closed as sent

    async def scenario() -> list[bytes]:
        client = Http1Client()
        seen = []
        async with script(ok(b"one"), hang_up, ok(b"two"), ok(b"x" * (4 * http1.HIGH_WATER))) as s:
            for _ in range(3):
                async with await post(client, s.url) as reply:
                    seen.append(await reply.read())
            assert s.connections == 2  # the second request met a closed connection and went on a fresh one
        await client.close()
        return seen

    seen = uvloop.run(scenario())
    assert seen == [b"one", b"two", b"x" * (4 * http1.HIGH_WATER)]
